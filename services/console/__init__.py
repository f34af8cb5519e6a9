"""What the operator sees: the console (Inflight's lines and where the libraries' logs go) and the start-up
progress lines."""
