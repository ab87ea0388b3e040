"""The front ends of an engine core: the in-process `LLMEngine` (offline) and `AsyncLLM`
(servers), with preprocessing, the core's client, detokenization and request streams."""
