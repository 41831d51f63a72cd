// Endpoints (http://host:port, https://host:port) and the redirect rules.
import { isIP } from "node:net";
import { status as Status } from "@grpc/grpc-js";
import { InvalidArgumentError, RedirectRefusedError } from "./errors.js";

/** One server: http://host:port or https://host:port. */
export class Endpoint {
  constructor(
    readonly scheme: "http" | "https",
    readonly host: string,
    readonly port: number,
  ) {}

  /** Reads "http://host:port" or "https://host:port" ("host:port" is http://; the port defaults to 80 or 443). */
  static parse(text: string): Endpoint {
    let raw = text.trim();
    if (!raw.includes("://")) raw = "http://" + raw;
    const bad = () =>
      new InvalidArgumentError(Status.INVALID_ARGUMENT, `endpoint: "${text}" is not http://host:port or https://host:port`);
    let url: URL;
    try {
      url = new URL(raw);
    } catch {
      throw bad();
    }
    const scheme = url.protocol.replace(/:$/, "");
    if ((scheme !== "http" && scheme !== "https") || !url.hostname || (url.pathname !== "" && url.pathname !== "/") ||
        url.search || url.username || url.password) {
      throw bad();
    }
    const host = url.hostname.replace(/^\[(.*)\]$/, "$1");
    const port = url.port ? Number(url.port) : scheme === "https" ? 443 : 80;
    return new Endpoint(scheme, host, port);
  }

  /** One endpoint, or several separated by commas (servers of one deployment). */
  static parseList(text: string | string[]): Endpoint[] {
    const parts = (Array.isArray(text) ? text : [text]).flatMap((t) => t.split(",")).filter((p) => p.trim() !== "");
    if (parts.length === 0) {
      throw new InvalidArgumentError(Status.INVALID_ARGUMENT, `endpoint: "${String(text)}" names no endpoint`);
    }
    return parts.map((p) => Endpoint.parse(p));
  }

  get secure(): boolean {
    return this.scheme === "https";
  }

  /** host:port as gRPC dials it. */
  get target(): string {
    return isIP(this.host) === 6 ? `[${this.host}]:${this.port}` : `${this.host}:${this.port}`;
  }

  /** localhost or a loopback address. */
  get loopback(): boolean {
    if (this.host === "localhost") return true;
    if (isIP(this.host) === 4) return this.host.startsWith("127.");
    return this.host === "::1";
  }

  equals(other: Endpoint): boolean {
    return this.scheme === other.scheme && this.host === other.host && this.port === other.port;
  }

  toString(): string {
    return `${this.scheme}://${this.target}`;
  }
}

/**
 * Applies the connection rules to following a redirect (or a standby's leader hint) from
 * current to target: never https:// to http://, and a token goes over plain http:// only to a
 * loopback host unless insecureRedirectHttp is set. Throws RedirectRefusedError.
 */
export function checkRedirect(current: Endpoint, target: Endpoint, hasToken: boolean, insecureRedirectHttp: boolean): void {
  if (current.secure && !target.secure) {
    throw new RedirectRefusedError(Status.FAILED_PRECONDITION,
      `redirect from ${current} to ${target} refused: never follow https:// to http://`);
  }
  if (hasToken && !target.secure && !target.loopback && !insecureRedirectHttp) {
    throw new RedirectRefusedError(Status.FAILED_PRECONDITION,
      `redirect to ${target} refused: the token would go over plain http:// to a non-loopback host ` +
      "(set insecureRedirectHttp, insecure_redirect_http, on trusted networks only)");
  }
}
