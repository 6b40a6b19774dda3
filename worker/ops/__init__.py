"""What operators run and read: the CLI, the runner that supervises the long-running parts, the
janitor, metrics and health over HTTP, and the admin, verify and permission tools."""
