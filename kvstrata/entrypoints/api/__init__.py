"""The HTTP layer: the FastAPI app (api_server), the OpenAI and native request models and
handlers, error bodies, PD request fields. Runs in the api server process; reaches the engine
only through the tokenizer manager (frontend/). The process layer (cli, launcher, scheduler
process, watchdog, engine factory, offline LLM) is the parent package."""
