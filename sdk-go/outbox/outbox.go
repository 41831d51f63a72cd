// Package outbox submits cronoq tasks in the application's own PostgreSQL transaction: each
// task is a row of the table "<schema>".cronoq_outbox (created by `cronoq outbox install`),
// which cronoq-server's relay submits once the transaction has committed. A transaction that
// rolls back leaves no row, and so no task.
//
// Enqueue and EnqueueMany take a pgx.Tx; EnqueueTx and EnqueueManyTx a *sql.Tx (any
// PostgreSQL driver). Each checks its tasks as the server would first: a bad task is an
// ErrInvalidArgument error (cronoq.ErrInvalidArgument) naming the field, and nothing is
// inserted. The main cronoq package does not import this one, so it does not pull in pgx.
package outbox

import (
	"context"
	"database/sql"
	"errors"
	"fmt"
	"regexp"
	"slices"
	"strings"

	"github.com/jackc/pgx/v5"
	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/proto"

	cronoq "github.com/cronoq/cronoq/sdk-go"
)

// DefaultSchema is the schema `cronoq outbox install` creates the outbox in by default.
const DefaultSchema = "cronoq"

// schemaName is what WithSchema admits: a plain identifier, so that quoting it is all it needs.
var schemaName = regexp.MustCompile(`^[A-Za-z_][A-Za-z0-9_]{0,62}$`)

// PostgreSQL takes at most 65,535 parameters in one statement, two a row here.
const maxRowsPerStatement = 65535 / 2

// Option changes how tasks are enqueued: WithSchema, WithMaxPayloadBytes.
type Option func(*options)

type options struct {
	schema          string
	maxPayloadBytes int
}

// WithSchema names the schema the outbox was installed in (DefaultSchema, "cronoq", when not
// given): letters, digits and _, at most 63, not starting with a digit.
func WithSchema(schema string) Option { return func(o *options) { o.schema = schema } }

// WithMaxPayloadBytes raises (or lowers) the largest payload admitted, to match the server's
// limits.max_payload_bytes when it is not the default (cronoq.DefaultMaxPayloadBytes, 1 MiB).
func WithMaxPayloadBytes(n int) Option { return func(o *options) { o.maxPayloadBytes = n } }

// Enqueue inserts one task in tx and returns its outbox row id. The task carries ctx's trace
// context, as cronoq.Client.Submit's does.
func Enqueue(ctx context.Context, tx pgx.Tx, spec cronoq.TaskSpec, opts ...Option) (int64, error) {
	ids, err := enqueue(ctx, pgxQuery(tx), []cronoq.TaskSpec{spec}, false, opts)
	if err != nil {
		return 0, err
	}
	return ids[0], nil
}

// EnqueueMany inserts the tasks in tx, all or none, and returns their outbox row ids in the
// order given (the order the relay submits them in). A bad task is an error naming its index
// (tasks[i].field), and none is inserted.
func EnqueueMany(ctx context.Context, tx pgx.Tx, specs []cronoq.TaskSpec, opts ...Option) ([]int64, error) {
	return enqueue(ctx, pgxQuery(tx), specs, true, opts)
}

// EnqueueTx is Enqueue for a database/sql transaction.
func EnqueueTx(ctx context.Context, tx *sql.Tx, spec cronoq.TaskSpec, opts ...Option) (int64, error) {
	ids, err := enqueue(ctx, sqlQuery(tx), []cronoq.TaskSpec{spec}, false, opts)
	if err != nil {
		return 0, err
	}
	return ids[0], nil
}

// EnqueueManyTx is EnqueueMany for a database/sql transaction.
func EnqueueManyTx(ctx context.Context, tx *sql.Tx, specs []cronoq.TaskSpec, opts ...Option) ([]int64, error) {
	return enqueue(ctx, sqlQuery(tx), specs, true, opts)
}

// queryIDs runs an INSERT ... RETURNING id and reads the ids.
type queryIDs func(ctx context.Context, statement string, args []any) ([]int64, error)

func enqueue(ctx context.Context, query queryIDs, specs []cronoq.TaskSpec, many bool, opts []Option) ([]int64, error) {
	o := options{schema: DefaultSchema}
	for _, opt := range opts {
		opt(&o)
	}
	if !schemaName.MatchString(o.schema) {
		return nil, &cronoq.Error{Code: codes.InvalidArgument, Message: fmt.Sprintf(
			"schema: %q is not a plain identifier (letters, digits and _, at most 63, not starting with a digit)", o.schema)}
	}
	// Every task is checked before the first statement: a bad one inserts nothing.
	args := make([]any, 0, 2*len(specs))
	for i, spec := range specs {
		req, err := cronoq.SubmitRequest(ctx, spec, o.maxPayloadBytes)
		if err != nil {
			if many {
				return nil, atIndex(err, i)
			}
			return nil, err
		}
		request, err := proto.MarshalOptions{Deterministic: true}.Marshal(req)
		if err != nil {
			return nil, fmt.Errorf("outbox: encoding tasks[%d]: %w", i, err)
		}
		args = append(args, req.GetPool(), request)
	}
	ids := make([]int64, 0, len(specs))
	for rows := range slices.Chunk(args, 2*maxRowsPerStatement) {
		chunk, err := query(ctx, insertStatement(o.schema, len(rows)/2), rows)
		if err != nil {
			return nil, fmt.Errorf("outbox: inserting into %q.cronoq_outbox: %w", o.schema, err)
		}
		// Identity values rise in the order the rows are inserted, which is the VALUES order.
		slices.Sort(chunk)
		ids = append(ids, chunk...)
	}
	return ids, nil
}

// insertStatement: INSERT of n rows (pool, request) as one multi-row VALUES, RETURNING the ids.
func insertStatement(schema string, n int) string {
	var b strings.Builder
	fmt.Fprintf(&b, `INSERT INTO "%s".cronoq_outbox (pool, request) VALUES `, schema)
	for i := range n {
		if i > 0 {
			b.WriteString(", ")
		}
		fmt.Fprintf(&b, "($%d, $%d)", 2*i+1, 2*i+2)
	}
	b.WriteString(" RETURNING id")
	return b.String()
}

// atIndex names the task of a batch a refusal is about: tasks[i].field.
func atIndex(err error, i int) error {
	var e *cronoq.Error
	if !errors.As(err, &e) {
		return fmt.Errorf("tasks[%d]: %w", i, err)
	}
	named := *e
	named.Message = fmt.Sprintf("tasks[%d].%s", i, e.Message)
	return &named
}

func pgxQuery(tx pgx.Tx) queryIDs {
	return func(ctx context.Context, statement string, args []any) ([]int64, error) {
		rows, err := tx.Query(ctx, statement, args...)
		if err != nil {
			return nil, err
		}
		return pgx.CollectRows(rows, pgx.RowTo[int64])
	}
}

func sqlQuery(tx *sql.Tx) queryIDs {
	return func(ctx context.Context, statement string, args []any) ([]int64, error) {
		rows, err := tx.QueryContext(ctx, statement, args...)
		if err != nil {
			return nil, err
		}
		defer rows.Close()
		var ids []int64
		for rows.Next() {
			var id int64
			if err := rows.Scan(&id); err != nil {
				return nil, err
			}
			ids = append(ids, id)
		}
		return ids, rows.Err()
	}
}
