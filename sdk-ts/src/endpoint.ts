// Endpoints ([http:// or https://]host[:port]) and the redirect rules. One parser reads every
// endpoint the SDK is given: the configured ones, a redirect's cronoq-shard-endpoint and a
// standby's cronoq-leader. It implements the grammar of conformance/README.md ("Endpoints")
// exactly and repairs nothing: an address parser's other forms (2130706433, 0177.0.0.1,
// user@host, percent-encoding) would send the token somewhere the text does not plainly say.
import { status as Status } from "@grpc/grpc-js";
import { InvalidArgumentError, RedirectRefusedError } from "./errors.js";

/** Characters no endpoint has, and what they would have meant. */
const NOT_IN_ENDPOINT: [string, string][] = [
  ["@", "user info (@)"],
  ["?", "a query (?)"],
  ["#", "a fragment (#)"],
  ["%", "percent-encoding or an IPv6 zone (%)"],
  ["\\", "a backslash (\\)"],
  [" ", "a space inside"],
  ["\t", "a tab inside"],
];

const LABEL = /^[A-Za-z0-9_-]{1,63}$/;
/** What an address parser reads as a number: decimal, or hex after 0x (0x7f000001 is 127.0.0.1 to inet_aton). */
const NUMBER = /^(?:[0-9]+|0[xX][0-9A-Fa-f]*)$/;
const HEX_GROUP = /^[0-9A-Fa-f]{1,4}$/;
const PORT = /^[1-9][0-9]*$/;

/** Trims the spaces and tabs around a text (only those: a newline is not an endpoint's). */
function trimBlanks(text: string): string {
  return text.replace(/^[ \t]+|[ \t]+$/g, "");
}

/** The four octets of a dotted-decimal IPv4 address (each 0-255, no leading zero), or undefined. */
function ipv4Octets(text: string): number[] | undefined {
  const parts = text.split(".");
  if (parts.length !== 4 || !parts.every((p) => /^(0|[1-9][0-9]{0,2})$/.test(p) && Number(p) <= 255)) return undefined;
  return parts.map(Number);
}

/**
 * The eight 16-bit groups of an IPv6 address in RFC 4291's text form (hex groups, one "::"
 * for one or more zero groups, optionally dotted IPv4 for the last two; no zone), or undefined.
 */
function ipv6Groups(text: string): number[] | undefined {
  const halves = text.split("::");
  if (halves.length > 2) return undefined;
  // Dotted IPv4 may only end the address: in the second half, or in the only one.
  const groups = (part: string, ipv4Last: boolean): number[] | undefined => {
    if (part === "") return [];
    const items = part.split(":");
    const out: number[] = [];
    for (const [i, item] of items.entries()) {
      const v4 = ipv4Last && i === items.length - 1 && item.includes(".") ? ipv4Octets(item) : undefined;
      if (v4) out.push(v4[0]! * 256 + v4[1]!, v4[2]! * 256 + v4[3]!);
      else if (HEX_GROUP.test(item)) out.push(parseInt(item, 16));
      else return undefined;
    }
    return out;
  };
  const head = groups(halves[0]!, halves.length === 1);
  if (halves.length === 1) return head?.length === 8 ? head : undefined;
  const tail = groups(halves[1]!, true);
  if (!head || !tail || head.length + tail.length > 7) return undefined;
  return [...head, ...Array<number>(8 - head.length - tail.length).fill(0), ...tail];
}

/** Why host (not in brackets) is neither a name nor an IPv4 address, or "" when it is one. */
function nameOrIpv4Problem(host: string): string {
  if (host === "") return "the host is empty";
  const labels = host.split(".");
  if (labels.some((l) => l === "")) return `"${host}" has an empty label (a trailing dot, or two dots in a row)`;
  if (!labels.every((l) => LABEL.test(l))) {
    return `"${host}" is not a name (labels of 1-63 letters, digits, - and _) nor an IPv4 address`;
  }
  if (NUMBER.test(labels[labels.length - 1]!) && !ipv4Octets(host)) {
    return `"${host}" ends in a number but is not an IPv4 address in dotted decimal (four numbers 0-255, no leading zero)`;
  }
  return "";
}

/**
 * Reads text as an endpoint: [scheme "://"] host [":" port] ["/"], the scheme http or https
 * (any case; http when absent), the port 1-65535 (80 or 443 when absent). Returns why text is
 * not an endpoint when it is not one; Endpoint.parse and parseTarget turn that into the error.
 */
export function readEndpoint(text: string): Endpoint | string {
  let rest = trimBlanks(text);
  const bad = NOT_IN_ENDPOINT.find(([char]) => rest.includes(char));
  if (bad) return `it has ${bad[1]}`;
  let scheme = "http";
  const sep = rest.indexOf("://");
  if (sep >= 0) {
    scheme = rest.slice(0, sep).toLowerCase();
    if (scheme !== "http" && scheme !== "https") return "the scheme is not http:// or https://";
    rest = rest.slice(sep + 3);
  }
  if (rest.endsWith("/")) rest = rest.slice(0, -1);
  if (rest.includes("/")) return "it has a path (only one / may end it)";
  let host: string;
  let port: string | undefined;
  if (rest.startsWith("[")) {
    const end = rest.indexOf("]");
    if (end < 0) return "the [ of an IPv6 address is not closed";
    host = rest.slice(1, end);
    const after = rest.slice(end + 1);
    if (after !== "" && !after.startsWith(":")) return `"${after}" follows the IPv6 address`;
    if (after !== "") port = after.slice(1);
    if (!ipv6Groups(host)) return `"[${host}]" is not an IPv6 address`;
  } else {
    if (rest.indexOf(":") !== rest.lastIndexOf(":")) return "it has more than one : outside brackets (an IPv6 address goes in [ ])";
    const colon = rest.indexOf(":");
    host = colon < 0 ? rest : rest.slice(0, colon);
    if (colon >= 0) port = rest.slice(colon + 1);
    const problem = nameOrIpv4Problem(host);
    if (problem) return problem;
  }
  if (port !== undefined && (!PORT.test(port) || Number(port) > 65535)) {
    return port === "" ? "the port is empty" : `the port "${port}" is not 1-65535 in decimal without a leading zero`;
  }
  const portNumber = port !== undefined ? Number(port) : scheme === "https" ? 443 : 80;
  return new Endpoint(scheme as "http" | "https", host.toLowerCase(), portNumber);
}

/** One server: http://host:port or https://host:port. */
export class Endpoint {
  constructor(
    readonly scheme: "http" | "https",
    /** A name in lower case, an IPv4 address, or an IPv6 address (without brackets). */
    readonly host: string,
    readonly port: number,
  ) {}

  /** Reads a configured endpoint (see readEndpoint); one that is not an endpoint is INVALID_ARGUMENT naming it. */
  static parse(text: string): Endpoint {
    const ep = readEndpoint(text);
    if (typeof ep === "string") {
      throw new InvalidArgumentError(Status.INVALID_ARGUMENT,
        `endpoint "${text}" is not an endpoint ([http:// or https://]host[:port]): ${ep}`);
    }
    return ep;
  }

  /** One endpoint, or several separated by commas (servers of one deployment). */
  static parseList(text: string | string[]): Endpoint[] {
    const parts = (Array.isArray(text) ? text : [text]).flatMap((t) => t.split(",")).filter((p) => trimBlanks(p) !== "");
    if (parts.length === 0) {
      throw new InvalidArgumentError(Status.INVALID_ARGUMENT, `endpoint: "${String(text)}" names no endpoint`);
    }
    return parts.map((p) => Endpoint.parse(p));
  }

  get secure(): boolean {
    return this.scheme === "https";
  }

  /** host:port as gRPC dials it (an IPv6 address in brackets). */
  get target(): string {
    return this.host.includes(":") ? `[${this.host}]:${this.port}` : `${this.host}:${this.port}`;
  }

  /** Exactly localhost, an address of 127.0.0.0/8, or ::1 (not ::ffff:127.0.0.1, not localhost.). */
  get loopback(): boolean {
    if (this.host.toLowerCase() === "localhost") return true;
    const v4 = ipv4Octets(this.host);
    if (v4) return v4[0] === 127;
    const v6 = ipv6Groups(this.host);
    return v6 !== undefined && v6.every((group, i) => group === (i === 7 ? 1 : 0));
  }

  equals(other: Endpoint): boolean {
    return this.scheme === other.scheme && this.host === other.host && this.port === other.port;
  }

  /** scheme://host:port, as the SDK reports an endpoint. */
  toString(): string {
    return `${this.scheme}://${this.target}`;
  }
}

/**
 * Reads the target of a redirect (cronoq-shard-endpoint) or a leader hint (cronoq-leader). One
 * that is not an endpoint is a refused redirect, before any connection: RedirectRefusedError
 * with code, the gRPC code of the answer that named the target.
 */
export function parseTarget(target: string, code: number): Endpoint {
  const ep = readEndpoint(target);
  if (typeof ep === "string") {
    throw new RedirectRefusedError(code, `redirect to "${target}" refused: not an endpoint: ${ep}`);
  }
  return ep;
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
