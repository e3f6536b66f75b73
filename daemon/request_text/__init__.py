"""Request text: a request's life as text (requests.py), the intake thread that templates
and tokenizes it (intake.py), tool calls and their grammar (tool_calls.py, tool_grammar.py),
reasoning (reasoning.py) and detokenizing (detokenize.py). It imports the engine
(daemon/engine/) only, never the engine thread or the socket side above it."""
