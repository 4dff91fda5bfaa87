"""Development tools: mutation testing, the probes of the command line, the GPU queue."""
