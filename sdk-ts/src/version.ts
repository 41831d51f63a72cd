/** This SDK's release (the package's version); sent in every call's user-agent as cronoq-ts/VERSION. */
export const VERSION = "0.2.0";
