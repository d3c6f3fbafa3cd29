"""Writing an index: build and merge a single one, build a sharded one, `build --ray`, and add/remove/repair written once against the layouts."""
