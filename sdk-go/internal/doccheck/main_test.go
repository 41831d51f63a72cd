package main

import (
	"slices"
	"testing"
)

func TestUndocumentedListsEachBareExportedIdentifier(t *testing.T) {
	got, err := undocumented("testdata/sample")
	if err != nil {
		t.Fatal(err)
	}
	want := []string{
		"testdata/sample/sample.go:1:9: package sample",
		"testdata/sample/sample.go:22:2: Lonely",
		"testdata/sample/sample.go:26:5: Global",
		"testdata/sample/sample.go:13:1: Func",
		"testdata/sample/sample.go:9:1: Bare",
		"testdata/sample/sample.go:11:1: (*Bare).Method",
	}
	if !slices.Equal(got, want) {
		t.Errorf("undocumented = %q, want %q", got, want)
	}
}
