"""What the edge and the cloud halves must agree on: the split-package format,
its manifest and the error tree. Pure logic, no sockets."""
