"""The gRPC door: the dgserve.v1 TextGeneration service on a grpc.aio server, in the same process and asyncio event
loop as the HTTP door, over the same AsyncEngine.

``door`` builds the server (grpc core's options, the call interceptor, TextGeneration, health, reflection);
``interceptors`` wraps every dgserve.v1 call (auth, request id, access log, metrics, error mapping);
``servicer`` answers the RPCs; ``convert`` turns protobuf into dgserve objects and the request's events
(``service.events``, shared with the HTTP door) into protobuf; ``errors`` maps exceptions to gRPC status codes.
Nothing here imports the HTTP door (``service.http``).
"""
