"""Small real models the demo and the tests train on the spot (no hub downloads)."""
