package cronoq

// Version is this SDK's release (its module's tag is sdk-go/v<Version>); it is sent in every
// call's user-agent as cronoq-go/<Version>.
const Version = "0.2.0"
