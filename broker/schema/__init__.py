"""JSON Schema admission: which schemas rsb's constrained decoding can enforce (enforceable), how a checked schema is
read (kinds), what one may cost the grammar engine per token (cost) and how big its grammar may get (grammar_size),
and a ``pattern`` parsed (pattern) and measured (pattern_cost). Pure Python, checked at create and again by the
engine (generator.engines.schema_grammar reads the same kinds and patterns)."""
