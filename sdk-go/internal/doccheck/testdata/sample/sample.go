package sample

// Documented has a doc comment.
type Documented struct{}

// Method has one too.
func (Documented) Method() {}

type Bare struct{}

func (*Bare) Method() {}

func Func() {}

// Limits are documented by their group's comment.
const (
	Low  = 1
	High = 2
)

const (
	Lonely   = 3
	Trailing = 4 // a line comment documents it
)

var Global int

func unexported() {}
