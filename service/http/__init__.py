"""The OpenAI-compatible HTTP front door: a FastAPI app on uvicorn, in the same process and asyncio event loop as
the grpc.aio server, over the same AsyncEngine (one engine, one scheduler, one admission limit).

``protocol`` turns OpenAI JSON into dgserve objects and events back into OpenAI JSON (the HTTP twin of
``convert``); ``errors`` maps exceptions to OpenAI error bodies and HTTP statuses; ``app`` holds the routes;
``front_door`` binds the port and runs uvicorn on the running loop.
"""
