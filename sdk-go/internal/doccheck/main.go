// Command doccheck fails when an exported identifier of the packages in the directories it is
// given has no doc comment, as the API reference (go doc -all) would show it bare. Generated
// files are skipped: their comments come from the protos.
package main

import (
	"fmt"
	"go/ast"
	"go/build"
	"go/doc"
	"go/parser"
	"go/token"
	"os"
	"path/filepath"
)

func main() {
	var missing []string
	for _, dir := range os.Args[1:] {
		found, err := undocumented(dir)
		if err != nil {
			fmt.Fprintln(os.Stderr, "doccheck:", err)
			os.Exit(2)
		}
		missing = append(missing, found...)
	}
	for _, m := range missing {
		fmt.Println(m)
	}
	if len(missing) > 0 {
		fmt.Fprintf(os.Stderr, "doccheck: %d exported identifiers without a doc comment\n", len(missing))
		os.Exit(1)
	}
}

// undocumented lists "file:line: name" for the package clause and each exported constant,
// variable, function, type and method of the package in dir that has no doc comment.
func undocumented(dir string) ([]string, error) {
	bp, err := build.ImportDir(dir, 0)
	if err != nil {
		return nil, err
	}
	fset := token.NewFileSet()
	var files []*ast.File
	for _, name := range bp.GoFiles {
		f, err := parser.ParseFile(fset, filepath.Join(dir, name), nil, parser.ParseComments)
		if err != nil {
			return nil, err
		}
		if !ast.IsGenerated(f) {
			files = append(files, f)
		}
	}
	if len(files) == 0 {
		return nil, nil
	}
	pkg, err := doc.NewFromFiles(fset, files, bp.ImportPath)
	if err != nil {
		return nil, err
	}
	var missing []string
	report := func(node ast.Node, name string) {
		missing = append(missing, fmt.Sprintf("%s: %s", fset.Position(node.Pos()), name))
	}
	if pkg.Doc == "" {
		report(files[0].Name, "package "+pkg.Name)
	}
	values := func(vs []*doc.Value) {
		for _, v := range vs {
			if v.Doc != "" {
				continue // a group's comment documents every name in it
			}
			for _, spec := range v.Decl.Specs {
				vspec := spec.(*ast.ValueSpec)
				if vspec.Doc != nil || vspec.Comment != nil {
					continue
				}
				for _, name := range vspec.Names {
					if name.IsExported() {
						report(name, name.Name)
					}
				}
			}
		}
	}
	funcs := func(fs []*doc.Func) {
		for _, f := range fs {
			if f.Doc != "" || f.Level > 0 { // a promoted method is documented where it is declared
				continue
			}
			if f.Recv != "" {
				report(f.Decl, fmt.Sprintf("(%s).%s", f.Recv, f.Name))
			} else {
				report(f.Decl, f.Name)
			}
		}
	}
	values(pkg.Consts)
	values(pkg.Vars)
	funcs(pkg.Funcs)
	for _, t := range pkg.Types {
		if t.Doc == "" {
			report(t.Decl, t.Name)
		}
		values(t.Consts)
		values(t.Vars)
		funcs(t.Funcs)
		funcs(t.Methods)
	}
	return missing, nil
}
