"""What a generation request is made of and how a create's body is parsed and validated, once, for every view:
the request itself (generation: GenerationRequest, its messages and limits), its sampling parameters (sampling),
typed-output fields (tools), the fields kept only to be shown back (echo), the service tier (tiers), what a
conversation's turn does while another runs (on_busy) and where server-assembled leading messages came from
(history). A schema the request asks rsb to enforce is admitted by broker.schema."""
