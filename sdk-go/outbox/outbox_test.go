package outbox_test

import (
	"context"
	"errors"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/timestamppb"

	cronoq "github.com/cronoq/cronoq/sdk-go"
	cronoqv1 "github.com/cronoq/cronoq/sdk-go/gen/cronoq/v1"
	"github.com/cronoq/cronoq/sdk-go/outbox"
)

// outboxRow is one row as the relay reads it: its pool and its request decoded.
type outboxRow struct {
	id      int64
	pool    string
	request *cronoqv1.SubmitTaskRequest
}

func readOutbox(t *testing.T, q interface {
	Query(context.Context, string, ...any) (pgx.Rows, error)
}, schema string) []outboxRow {
	t.Helper()
	rows, err := q.Query(context.Background(), `SELECT id, pool, request FROM "`+schema+`".cronoq_outbox ORDER BY id`)
	if err != nil {
		t.Fatal(err)
	}
	got, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (outboxRow, error) {
		var row outboxRow
		var data []byte
		if err := r.Scan(&row.id, &row.pool, &data); err != nil {
			return row, err
		}
		row.request = &cronoqv1.SubmitTaskRequest{}
		return row, proto.Unmarshal(data, row.request)
	})
	if err != nil {
		t.Fatal(err)
	}
	return got
}

func TestEnqueueInsertsTheSubmitRequestInTheTransaction(t *testing.T) {
	schema, conn := testSchema(t)
	ctx := context.Background()
	runAt := time.Date(2030, 1, 2, 3, 4, 5, 0, time.UTC)
	spec := cronoq.TaskSpec{
		Pool: "emails", Payload: map[string]string{"to": "a@example.com"}, Key: "welcome-42",
		Priority: -3, RunAt: runAt, MaxAttempts: 7, Timeout: 90 * time.Second, GroupKey: "tenant-1",
		DependsOn: []cronoq.TaskRef{cronoq.ByID(12), cronoq.ByKey("signup-42")},
		RunWhen:   cronoq.RunWhenDependenciesEnded, Resources: map[string]int64{"smtp": 1},
		KeyMode: cronoq.KeyModeReplacePending, KeyTTL: 24 * time.Hour, StartBy: runAt.Add(time.Hour),
	}
	tx, err := conn.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	id, err := outbox.Enqueue(ctx, tx, spec, outbox.WithSchema(schema))
	if err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	want := &cronoqv1.SubmitTaskRequest{
		Pool: "emails", Key: "welcome-42", Payload: []byte(`{"to":"a@example.com"}`),
		ContentType: cronoq.JSONContentType, Priority: -3, RunAt: timestamppb.New(runAt), MaxAttempts: 7,
		TimeoutMs: 90_000, GroupKey: "tenant-1", Resources: map[string]int64{"smtp": 1},
		RunWhen: cronoqv1.RunWhen_RUN_WHEN_DEPENDENCIES_ENDED,
		KeyMode: cronoqv1.KeyMode_KEY_MODE_REPLACE_PENDING, KeyTtlMs: 86_400_000, StartBy: timestamppb.New(runAt.Add(time.Hour)),
		DependsOn: []*cronoqv1.TaskRef{
			{Ref: &cronoqv1.TaskRef_Id{Id: 12}}, {Ref: &cronoqv1.TaskRef_Key{Key: "signup-42"}},
		},
	}
	rows := readOutbox(t, conn, schema)
	if len(rows) != 1 || rows[0].id != id || rows[0].pool != "emails" {
		t.Fatalf("rows %+v, want one of id %d in pool emails", rows, id)
	}
	if !proto.Equal(rows[0].request, want) {
		t.Fatalf("request\n%v\nwant\n%v", rows[0].request, want)
	}
	if rows[0].request.GetRequestId() != "" {
		t.Fatalf("request_id %q: the relay sets its own", rows[0].request.GetRequestId())
	}
}

func TestEnqueueManyTxInsertsInOrderWithDatabaseSQL(t *testing.T) {
	schema, conn := testSchema(t)
	db := openSQL(t)
	ctx := context.Background()
	tx, err := db.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	specs := []cronoq.TaskSpec{
		{Pool: "b", Payload: []byte("raw")},
		{Pool: "a", Payload: 1, Key: "k1"},
		{Pool: "b", Payload: nil, DependsOn: []cronoq.TaskRef{cronoq.ByKey("k1")}},
	}
	ids, err := outbox.EnqueueManyTx(ctx, tx, specs, outbox.WithSchema(schema))
	if err != nil {
		t.Fatal(err)
	}
	one, err := outbox.EnqueueTx(ctx, tx, cronoq.TaskSpec{Pool: "c"}, outbox.WithSchema(schema))
	if err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(); err != nil {
		t.Fatal(err)
	}
	rows := readOutbox(t, conn, schema)
	if len(ids) != 3 || len(rows) != 4 {
		t.Fatalf("ids %v, rows %+v: want 3 ids and 4 rows", ids, rows)
	}
	for i, spec := range specs {
		want, err := cronoq.SubmitRequest(ctx, spec, 0)
		if err != nil {
			t.Fatal(err)
		}
		if rows[i].id != ids[i] || rows[i].pool != spec.Pool || !proto.Equal(rows[i].request, want) {
			t.Fatalf("row %d: %+v, want id %d and %v", i, rows[i], ids[i], want)
		}
	}
	if rows[3].id != one || rows[3].pool != "c" {
		t.Fatalf("row 3: %+v, want id %d in pool c", rows[3], one)
	}
}

func TestRolledBackTransactionLeavesNoRow(t *testing.T) {
	schema, conn := testSchema(t)
	db := openSQL(t)
	ctx := context.Background()
	tx, err := conn.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := outbox.EnqueueMany(ctx, tx, []cronoq.TaskSpec{{Pool: "p"}, {Pool: "q"}}, outbox.WithSchema(schema)); err != nil {
		t.Fatal(err)
	}
	if n := len(readOutbox(t, tx, schema)); n != 2 {
		t.Fatalf("%d rows inside the transaction, want 2", n)
	}
	if err := tx.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	sqlTx, err := db.BeginTx(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := outbox.EnqueueTx(ctx, sqlTx, cronoq.TaskSpec{Pool: "p"}, outbox.WithSchema(schema)); err != nil {
		t.Fatal(err)
	}
	if err := sqlTx.Rollback(); err != nil {
		t.Fatal(err)
	}
	if rows := readOutbox(t, conn, schema); len(rows) != 0 {
		t.Fatalf("rows %+v after rollbacks, want none", rows)
	}
}

func TestBadTaskFailsInTheTransactionBeforeAnyInsert(t *testing.T) {
	schema, conn := testSchema(t)
	ctx := context.Background()
	cases := []struct {
		name  string
		specs []cronoq.TaskSpec
		opts  []outbox.Option
		want  string
	}{
		{"no pool", []cronoq.TaskSpec{{Payload: 1}}, nil, "pool: required"},
		{"scheduled key", []cronoq.TaskSpec{{Pool: "p", Key: "schedule:x"}}, nil, `key: "schedule:x"`},
		{"control character", []cronoq.TaskSpec{{Pool: "p", GroupKey: "a\u202eb"}}, nil, "group_key: control character"},
		{"payload", []cronoq.TaskSpec{{Pool: "p", Payload: make([]byte, cronoq.DefaultMaxPayloadBytes+1)}}, nil,
			"payload: 1048577 bytes exceeds limits.max_payload_bytes 1048576"},
		{"payload under a lower limit", []cronoq.TaskSpec{{Pool: "p", Payload: []byte("12345")}},
			[]outbox.Option{outbox.WithMaxPayloadBytes(4)}, "payload: 5 bytes exceeds limits.max_payload_bytes 4"},
		{"second of a batch", []cronoq.TaskSpec{{Pool: "p"}, {Pool: "p", MaxAttempts: 1001}}, nil,
			"tasks[1].max_attempts: 1001 is not between 0 and 1000"},
		{"debounce without its mode", []cronoq.TaskSpec{{Pool: "p", Key: "k", KeyMode: cronoq.KeyModeReplacePending, Debounce: time.Second}}, nil,
			"debounce_ms: 1000 applies only with KEY_MODE_DEBOUNCE, not KEY_MODE_REPLACE_PENDING"},
		{"schema", []cronoq.TaskSpec{{Pool: "p"}}, []outbox.Option{outbox.WithSchema(`x"; DROP TABLE t; --`)},
			`schema: "x\"; DROP TABLE t; --" is not a plain identifier`},
	}
	tx, err := conn.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	for _, c := range cases {
		opts := append([]outbox.Option{outbox.WithSchema(schema)}, c.opts...)
		var err error
		if len(c.specs) == 1 {
			_, err = outbox.Enqueue(ctx, tx, c.specs[0], opts...)
		} else {
			_, err = outbox.EnqueueMany(ctx, tx, c.specs, opts...)
		}
		if !errors.Is(err, cronoq.ErrInvalidArgument) || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: error %v, want INVALID_ARGUMENT with %q", c.name, err, c.want)
		}
	}
	// No statement ran: the transaction is still usable, and holds no row.
	if rows := readOutbox(t, tx, schema); len(rows) != 0 {
		t.Fatalf("rows %+v, want none", rows)
	}
}

func TestMaxPayloadBytesRaisesTheLimit(t *testing.T) {
	schema, conn := testSchema(t)
	ctx := context.Background()
	tx, err := conn.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	payload := make([]byte, cronoq.DefaultMaxPayloadBytes+1)
	_, err = outbox.Enqueue(ctx, tx, cronoq.TaskSpec{Pool: "p", Payload: payload}, outbox.WithSchema(schema), outbox.WithMaxPayloadBytes(2<<20))
	if err != nil {
		t.Fatal(err)
	}
	if rows := readOutbox(t, tx, schema); len(rows) != 1 || len(rows[0].request.GetPayload()) != len(payload) {
		t.Fatalf("rows %+v, want one with the payload", rows)
	}
}

func TestDefaultSchemaIsCronoq(t *testing.T) {
	_, conn := testSchema(t)
	ctx := context.Background()
	tx, err := conn.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer func() { _ = tx.Rollback(ctx) }()
	// In the transaction only: the "cronoq" schema is gone with its rollback.
	if _, err := tx.Exec(ctx, strings.ReplaceAll(strings.ReplaceAll(outboxDDL, "IF NOT EXISTS ", ""), "%[1]s", `"cronoq"`)); err != nil {
		t.Fatal(err)
	}
	id, err := outbox.Enqueue(ctx, tx, cronoq.TaskSpec{Pool: "p"})
	if err != nil {
		t.Fatal(err)
	}
	if rows := readOutbox(t, tx, "cronoq"); len(rows) != 1 || rows[0].id != id {
		t.Fatalf("rows %+v, want one of id %d", rows, id)
	}
}

func TestMainPackageDoesNotImportPgx(t *testing.T) {
	out, err := exec.Command("go", "list", "-deps", "github.com/cronoq/cronoq/sdk-go").CombinedOutput()
	if err != nil {
		t.Fatalf("go list: %v\n%s", err, out)
	}
	if strings.Contains(string(out), "github.com/jackc/") {
		t.Fatalf("the cronoq package depends on pgx:\n%s", out)
	}
}
