"""The HTTP edge of the API pod: what a request meets before any stream is touched. Bare-connection guards
(guards), who is calling (auth, middleware), per-address and per-key connection limits (limits), bounded bodies
(http), the front door of the readers' route (front), and the one boundary where errors become HTTP (errors)."""
