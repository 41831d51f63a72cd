// What the unit tests share.
import { BinaryWriter } from "@bufbuild/protobuf/wire";
import { ServerCredentials, type Server } from "@grpc/grpc-js";

/** The largest uint64 id: its top bit set, it does not fit a number. */
export const TOP_BIT_ID = 18446744073709551615n;

/** A logger that writes nothing. */
export const silent = { debug() {}, info() {}, warn() {}, error() {} };

/** Binds server to a free loopback port (plaintext); answers its http:// URL. */
export async function listenLocal(server: Server): Promise<string> {
  const port = await new Promise<number>((resolve, reject) =>
    server.bindAsync("127.0.0.1:0", ServerCredentials.createInsecure(), (err, p) => (err ? reject(err) : resolve(p))));
  return `http://127.0.0.1:${port}`;
}

/** A google.rpc.Status (code 9, message) with an ErrorInfo and a RetryInfo, serialized as grpc-status-details-bin carries it. */
export function statusDetailsBin(reason: string, metadata: Record<string, string>, retryDelayMs = 0, message = "refused"): Buffer {
  const info = new BinaryWriter().uint32(10).string(reason).uint32(18).string("cronoq.dev");
  for (const [k, v] of Object.entries(metadata)) {
    info.uint32(26).fork().uint32(10).string(k).uint32(18).string(v).join();
  }
  const any = (typeUrl: string, value: Uint8Array) => new BinaryWriter().uint32(10).string(typeUrl).uint32(18).bytes(value).finish();
  const w = new BinaryWriter().uint32(8).int32(9).uint32(18).string(message);
  w.uint32(26).bytes(any("type.googleapis.com/google.rpc.ErrorInfo", info.finish()));
  if (retryDelayMs > 0) {
    const duration = new BinaryWriter().uint32(8).int64(Math.floor(retryDelayMs / 1000)).uint32(16).int32((retryDelayMs % 1000) * 1e6).finish();
    const retry = new BinaryWriter().uint32(10).bytes(duration).finish();
    w.uint32(26).bytes(any("type.googleapis.com/google.rpc.RetryInfo", retry));
  }
  return Buffer.from(w.finish());
}
