"""Everything that owns tensors and devices: model runner, encoder runner, embedding store."""
