"""OpenAI's wire format as SpaceServe serves it: request models and response builders,
chat preprocessing, sampling fields, logprobs, text completions, body reading and SSE streams
(see the parent package's map)."""
