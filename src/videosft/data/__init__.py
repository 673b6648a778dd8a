"""The files stages hand each other and the user's inputs: one module owns each file's schema, writer and reader."""
