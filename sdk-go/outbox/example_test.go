package outbox_test

import (
	"context"

	"github.com/jackc/pgx/v5/pgxpool"

	cronoq "github.com/cronoq/cronoq/sdk-go"
	"github.com/cronoq/cronoq/sdk-go/outbox"
)

// The README's example: an order and the task that mails it commit together, or neither does.
func ExampleEnqueue() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, "postgresql://app@localhost/app")
	if err != nil {
		panic(err)
	}
	placeOrder := func(orderID, email string) error {
		tx, err := pool.Begin(ctx)
		if err != nil {
			return err
		}
		defer func() { _ = tx.Rollback(ctx) }() // after Commit, a no-op
		if _, err := tx.Exec(ctx, "INSERT INTO orders (id, email) VALUES ($1, $2)", orderID, email); err != nil {
			return err
		}
		spec := cronoq.TaskSpec{Pool: "emails", Payload: map[string]any{"order": orderID}, Key: "order-mail-" + orderID}
		if _, err := outbox.Enqueue(ctx, tx, spec); err != nil {
			return err // a bad task: cronoq.ErrInvalidArgument, nothing inserted
		}
		return tx.Commit(ctx) // the task exists once this commits
	}
	_ = placeOrder
}
