"""The embedding-handle protocol between an encoder and the engines that read its rows: handles
(shared memory, CUDA IPC, bytes), their wire form, the consumer's ledger, delivered images."""
