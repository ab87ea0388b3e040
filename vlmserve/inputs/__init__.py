"""A request's input as the model reads it: prompts, images, videos and chat messages checked
and turned into token ids and encoder inputs (below both the engine and the encoder service)."""
