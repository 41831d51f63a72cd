// A map-reduce as a cronoq workflow: a root task spawns 100 map tasks, each returning a
// number, and a join that depends on all of them and returns their sum. It submits the root,
// runs a worker until the join has ended, prints the sum and exits 0 (1 when it failed).
//
//	go run ./examples/mapreduce -endpoint http://127.0.0.1:7070 -pool default
//
// The endpoint and token also come from CRONOQ_ENDPOINT and CRONOQ_TOKEN.
package main

import (
	"context"
	"flag"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"time"

	"github.com/cronoq/cronoq/sdk-go"
)

const mappers = 100

// step is every task's payload: the root, one map task (n), or the join.
type step struct {
	Kind string `json:"kind"`
	N    int    `json:"n,omitempty"`
}

// spawned is the root's result: the key of the join, which the caller waits for.
type spawned struct {
	Join string `json:"join"`
}

func handle(ctx context.Context, task *cronoq.Task) (any, error) {
	var in step
	if err := cronoq.DecodePayload(task, &in); err != nil {
		return nil, cronoq.NonRetryable(err)
	}
	t := cronoq.TaskContextFrom(ctx)
	switch in.Kind {
	case "root":
		// Keys name the tasks the join depends on; the root's id keeps them apart from another run's.
		var mapped []cronoq.TaskRef
		for n := 1; n <= mappers; n++ {
			key := fmt.Sprintf("mapreduce-%d-map-%d", task.GetId(), n)
			if err := t.Spawn(task.GetPool(), step{Kind: "map", N: n}, cronoq.SpawnKey(key)); err != nil {
				return nil, cronoq.NonRetryable(err)
			}
			mapped = append(mapped, cronoq.ByKey(key))
		}
		join := fmt.Sprintf("mapreduce-%d-join", task.GetId())
		if err := t.Spawn(task.GetPool(), step{Kind: "join"}, cronoq.SpawnKey(join), cronoq.SpawnDependsOn(mapped...)); err != nil {
			return nil, cronoq.NonRetryable(err)
		}
		return spawned{Join: join}, nil // the children are created with this success, or not at all
	case "map":
		return in.N * in.N, nil
	case "join":
		sum := 0
		for _, d := range t.DependencyResults() { // every map task's result, in depends_on order
			var n int
			if err := d.Decode(&n); err != nil {
				return nil, cronoq.NonRetryable(err)
			}
			sum += n
		}
		return sum, nil
	}
	return nil, cronoq.NonRetryable(fmt.Errorf("unknown kind %q", in.Kind))
}

func main() {
	endpoint := flag.String("endpoint", envOr("CRONOQ_ENDPOINT", cronoq.DefaultEndpoint), "the server (several: comma-separated)")
	pool := flag.String("pool", "default", "the pool to submit to and work on")
	flag.Parse()
	if err := run(*endpoint, *pool); err != nil {
		fmt.Fprintln(os.Stderr, "example:", err)
		os.Exit(1)
	}
}

func run(endpoint, pool string) error {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt)
	defer stop()
	opts := cronoq.Options{Endpoint: endpoint, Token: os.Getenv("CRONOQ_TOKEN"), Logger: slog.Default()}

	client, err := cronoq.NewClient(opts)
	if err != nil {
		return err
	}
	defer client.Close()
	sub, err := client.Submit(ctx, cronoq.TaskSpec{Pool: pool, Payload: step{Kind: "root"}})
	if err != nil {
		return fmt.Errorf("submit: %w", err)
	}
	root := sub.Task.GetId()
	fmt.Printf("submitted the root task %d\n", root)

	worker, err := cronoq.NewWorker(cronoq.WorkerOptions{Options: opts, Pools: []string{pool}, Concurrency: 16}, handle)
	if err != nil {
		return err
	}
	workerCtx, stopWorker := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- worker.Run(workerCtx) }()
	sum, err := await(ctx, client, root)
	stopWorker() // a graceful stop: running tasks finish, the others are given back
	if runErr := <-done; err == nil {
		err = runErr
	}
	if err != nil {
		return err
	}
	fmt.Printf("sum of %d children: %d\n", mappers, sum)
	return nil
}

// await waits for the root, then for the join it spawned, and returns the join's result.
func await(ctx context.Context, client *cronoq.Client, root uint64) (int, error) {
	rootTask, err := succeeded(ctx, client, cronoq.ByID(root))
	if err != nil {
		return 0, err
	}
	var out spawned
	if err := cronoq.DecodeResult(rootTask, &out); err != nil {
		return 0, err
	}
	details, err := client.GetWith(ctx, cronoq.ByID(root), cronoq.GetOptions{IncludeChildren: true})
	if err != nil {
		return 0, err
	}
	fmt.Printf("the root task %d spawned %d tasks; the join is %s\n", root, len(details.Children), out.Join)
	join, err := succeeded(ctx, client, cronoq.ByKey(out.Join))
	if err != nil {
		return 0, err
	}
	var sum int
	if err := cronoq.DecodeResult(join, &sum); err != nil {
		return 0, err
	}
	return sum, nil
}

// succeeded waits for a task to succeed; one that ends otherwise, or is not done in 90 s, is an error.
func succeeded(ctx context.Context, client *cronoq.Client, ref cronoq.TaskRef) (*cronoq.Task, error) {
	waited, err := client.Wait(ctx, ref, 90*time.Second)
	switch {
	case err != nil:
		return nil, fmt.Errorf("wait: %w", err)
	case !waited.Done:
		return nil, fmt.Errorf("task %d not done after 90 s: %s", waited.Task.GetId(), waited.Task.GetState())
	case waited.Task.GetState() != cronoq.TaskStateSucceeded:
		return nil, fmt.Errorf("task %d ended %s: %s", waited.Task.GetId(), waited.Task.GetState(), waited.Task.GetError())
	}
	return waited.Task, nil
}

func envOr(key, fallback string) string {
	if v := os.Getenv(key); v != "" {
		return v
	}
	return fallback
}
