"""The decoder families the torch engine runs, one module each (`spec` the maths they vary,
`base` what they share, `registry` the lookup). Adding a family is a module here and a line in
`registry.FAMILIES`; nothing else in the engine names a family."""
