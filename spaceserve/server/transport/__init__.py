"""What sits below the routes: errors as OpenAI-style JSON, the admission middleware, uvicorn
with a connection cap, a header deadline and a bounded shutdown, and a server thread for tests
(see the parent package's map)."""
