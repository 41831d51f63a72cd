// A fake shard the worker tests share: an in-process grpc-js server that plays cronoq's worker
// service (and the task service's submit, get and watch, the schedule service's put), and
// records what it was sent.
import { after } from "node:test";
import {
  Metadata,
  Server,
  status as Status,
  type sendUnaryData,
  type ServerDuplexStream,
  type ServerUnaryCall,
  type ServerWritableStream,
  type UntypedServiceImplementation,
} from "@grpc/grpc-js";
import {
  TaskServiceService,
  GetTaskResponse,
  SubmitBatchResponse,
  SubmitTaskResponse,
  type GetTaskRequest,
  type SubmitBatchRequest,
  type SubmitTaskRequest,
  type WatchRequest,
  type WatchResponse,
} from "../src/gen/cronoq/v1/task_service.js";
import {
  WorkerServiceService,
  type RegisterWorkerRequest,
  type RegisterWorkerResponse,
  type TaskOutcome,
  type TaskReport,
  type WorkRequest,
  type WorkResponse,
} from "../src/gen/cronoq/v1/worker_service.js";
import { ScheduleServiceService, type PutScheduleRequest, type PutScheduleResponse, type Schedule } from "../src/gen/cronoq/v1/schedule_service.js";
import { Task, TaskState, type TaskEvent } from "../src/gen/cronoq/v1/task.js";
import { listenLocal, statusDetailsBin, TOP_BIT_ID } from "./helpers.js";

// Whatever a failed test leaves running is stopped, so that the run ends.
const started: Array<{ stop(): void }> = [];
after(() => started.forEach((s) => s.stop()));
export function tracked<T extends { stop(): void }>(thing: T): T {
  started.push(thing);
  return thing;
}

/** One Watch call of a FakeShard: where it says it starts, its events, then a failure or a clean end. */
export interface WatchStep {
  start?: string;
  events: TaskEvent[];
  fail?: boolean;
}

export interface FakeOptions {
  watch?: WatchStep[];
  tasks?: Task[];
  cancel?: bigint[];
  redirectTo?: () => string;
  /** The first stream fails with UNAVAILABLE on the first outcomes, without answering them. */
  failFirstStream?: boolean;
  /** Every stream is answered UNAVAILABLE on its first message. */
  refuseStreams?: boolean;
  /** RegisterWorker's; 100 ms when absent. */
  heartbeatIntervalMs?: number;
  /** RegisterWorker's; 0 (none stated) when absent. */
  maxCheckpointBytes?: bigint;
  /** The first stream fails with UNAVAILABLE on the first heartbeat that carries reports, without answering it. */
  failFirstStreamOnReports?: boolean;
  /** A heartbeat's answer is sent on its own this long after the heartbeat (the rest of the message's at once). */
  heartbeatAnswerDelayMs?: number;
  /** The tasks whose outcomes are refused (accepted false, LEASE_LOST). */
  refuse?: bigint[];
  /** The tasks a heartbeat naming them is answered "lost" for. */
  lost?: bigint[];
}

/** The reports one heartbeat carried, the stream it came on (1 for the first), and whether it was answered. */
interface BeatReports {
  stream: number;
  reports: TaskReport[];
  answered: boolean;
}

/** A server that registers workers (or redirects them), hands out each of its tasks once as credits allow, and records outcomes. */
export class FakeShard {
  readonly server = new Server();
  url = "";
  readonly outcomes: TaskOutcome[] = [];
  readonly firstCredits: number[] = []; // each stream's first message's credits
  readonly firstSlots: number[] = []; // each stream's first message's slots
  laterSlots = 0; // messages after a stream's first that set slots (the server refuses them)
  readonly messagesWithOutcomes: number[] = [];
  readonly heartbeats: bigint[][] = [];
  readonly beatReports: BeatReports[] = [];
  registers = 0;
  streams = 0;
  deregistered = false;
  tokens: string[] = [];
  readonly watchCursors: string[] = [];
  /** Each SubmitTask's and SubmitBatch's tasks, as received; answered as tasks 1, 2, ... with what they gave (their trace too). */
  readonly submitted: SubmitTaskRequest[] = [];
  /** Each PutSchedule's schedule, as received; answered as stored, with a next fire. */
  readonly schedules: Schedule[] = [];

  constructor(private readonly opts: FakeOptions = {}) {
    const queue = [...(opts.tasks ?? [])]; // a task leased stays leased: never sent twice
    const impl: UntypedServiceImplementation = {
      registerWorker: (call: ServerUnaryCall<RegisterWorkerRequest, RegisterWorkerResponse>, cb: sendUnaryData<RegisterWorkerResponse>) => {
        this.registers++;
        this.tokens.push(String(call.metadata.get("authorization")[0] ?? ""));
        if (opts.redirectTo) {
          const md = new Metadata();
          md.set("cronoq-shard-endpoint", opts.redirectTo());
          md.set("cronoq-shard", "gpu");
          cb({ code: Status.FAILED_PRECONDITION, details: "pool gpu is on shard gpu", metadata: md });
          return;
        }
        cb(null, {
          workerId: "w1", heartbeatIntervalMs: opts.heartbeatIntervalMs ?? 100, shard: "cpu", maxResultBytes: 0n, maxLeaseBytes: 0n,
          maxCheckpointBytes: opts.maxCheckpointBytes ?? 0n,
        });
      },
      deregisterWorker: (_call: unknown, cb: sendUnaryData<object>) => {
        this.deregistered = true;
        cb(null, {});
      },
      work: (call: ServerDuplexStream<WorkRequest, WorkResponse>) => {
        const stream = ++this.streams;
        let credits = 0;
        let first = true;
        call.on("data", (req: WorkRequest) => {
          if (opts.refuseStreams) {
            call.emit("error", { code: Status.UNAVAILABLE, details: "going away" });
            return;
          }
          if (first) {
            this.firstCredits.push(req.credits);
            this.firstSlots.push(req.slots);
          } else if (req.slots !== 0) {
            this.laterSlots++;
          }
          first = false;
          credits += req.credits;
          if (opts.failFirstStream && stream === 1 && req.outcomes.length > 0) {
            this.outcomes.push(...req.outcomes);
            call.emit("error", { code: Status.UNAVAILABLE, details: "draining" });
            return;
          }
          const beat = req.heartbeat && { stream, reports: req.heartbeat.reports, answered: false };
          if (beat) this.beatReports.push(beat);
          if (opts.failFirstStreamOnReports && stream === 1 && (req.heartbeat?.reports.length ?? 0) > 0) {
            call.emit("error", { code: Status.UNAVAILABLE, details: "draining" });
            return;
          }
          const answer: WorkResponse = { tasks: [], results: [], heartbeat: undefined };
          if (req.outcomes.length > 0) this.messagesWithOutcomes.push(req.outcomes.length);
          for (const o of req.outcomes) {
            this.outcomes.push(o);
            answer.results.push(opts.refuse?.includes(o.taskId)
              ? { taskId: o.taskId, accepted: false, code: "LEASE_LOST", message: "the task is not leased to this worker" }
              : { taskId: o.taskId, accepted: true, code: "", message: "" });
          }
          if (req.heartbeat) {
            const ids = req.heartbeat.tasks.map((t) => t.taskId);
            this.heartbeats.push(ids);
            answer.heartbeat = {
              cancelledTaskIds: ids.filter((id) => opts.cancel?.includes(id)),
              lostTaskIds: ids.filter((id) => opts.lost?.includes(id)),
            };
          }
          while (credits > 0 && queue.length > 0) {
            answer.tasks.push(queue.shift()!);
            credits--;
          }
          if (beat && opts.heartbeatAnswerDelayMs !== undefined) {
            const late: WorkResponse = { tasks: [], results: [], heartbeat: answer.heartbeat };
            answer.heartbeat = undefined;
            setTimeout(() => {
              if (!call.writable) return;
              beat.answered = true;
              call.write(late);
            }, opts.heartbeatAnswerDelayMs).unref();
          } else if (beat) {
            beat.answered = true;
          }
          call.write(answer);
        });
        call.on("end", () => call.end());
      },
    };
    this.server.addService(WorkerServiceService, impl);
    this.server.addService(TaskServiceService, {
      watch: (call: ServerWritableStream<WatchRequest, WatchResponse>) => {
        this.watchCursors.push(call.request.cursor);
        const step = opts.watch?.shift() ?? { events: [], fail: true };
        const md = new Metadata();
        if (step.start) {
          md.set("cronoq-watch-cursor", step.start);
          call.sendMetadata(md);
        }
        for (const event of step.events) call.write({ event });
        if (step.fail) call.emit("error", { code: Status.UNAVAILABLE, details: "shutting down", metadata: md });
        else call.end(md);
      },
      submitTask: (call: ServerUnaryCall<SubmitTaskRequest, SubmitTaskResponse>, cb: sendUnaryData<SubmitTaskResponse>) => {
        cb(null, SubmitTaskResponse.fromPartial({ task: this.accept(call.request) }));
      },
      submitBatch: (call: ServerUnaryCall<SubmitBatchRequest, SubmitBatchResponse>, cb: sendUnaryData<SubmitBatchResponse>) => {
        cb(null, SubmitBatchResponse.fromPartial({ tasks: call.request.tasks.map((req) => this.accept(req)) }));
      },
      getTask: (call: ServerUnaryCall<GetTaskRequest, GetTaskResponse>, cb: sendUnaryData<GetTaskResponse>) => {
        const id = call.request.task?.id;
        if (id !== TOP_BIT_ID) {
          const md = new Metadata();
          md.set("grpc-status-details-bin", statusDetailsBin("TASK_NOT_FOUND", {}));
          cb({ code: Status.NOT_FOUND, details: `no task ${id}`, metadata: md });
          return;
        }
        cb(null, GetTaskResponse.fromPartial({ task: Task.fromPartial({ id, state: TaskState.TASK_STATE_RUNNING }) }));
      },
    });
    this.server.addService(ScheduleServiceService, {
      putSchedule: (call: ServerUnaryCall<PutScheduleRequest, PutScheduleResponse>, cb: sendUnaryData<PutScheduleResponse>) => {
        this.schedules.push(call.request.schedule!);
        cb(null, { schedule: { ...call.request.schedule!, nextFireAt: { seconds: 1_700_000_060n, nanos: 0 } } });
      },
    });
  }

  /** Records a submitted task; answers it as the server would (PENDING, its id the next). */
  private accept(req: SubmitTaskRequest): Task {
    this.submitted.push(req);
    return Task.fromPartial({
      id: BigInt(this.submitted.length), pool: req.pool, key: req.key, payload: req.payload, contentType: req.contentType,
      state: TaskState.TASK_STATE_PENDING, trace: req.trace,
    });
  }

  async start(): Promise<this> {
    tracked(this);
    this.url = await listenLocal(this.server);
    return this;
  }

  stop(): void {
    this.server.forceShutdown();
  }
}

export function jsonTask(id: bigint, payload: unknown): Task {
  return Task.fromPartial({ id, attempt: 1, pool: "default", payload: Buffer.from(JSON.stringify(payload)), contentType: "application/json" });
}

export async function until(check: () => boolean, ms = 5000): Promise<void> {
  const deadline = Date.now() + ms;
  while (!check()) {
    if (Date.now() > deadline) throw new Error("timed out waiting");
    await new Promise((r) => setTimeout(r, 5));
  }
}
