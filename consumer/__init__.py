"""The stateless HTTP/SSE API: create, read/resume/tail, status, cancel."""
