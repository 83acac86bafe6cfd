"""Models: which a forest runs exactly, how they are read and loaded, and the converted-model cache.

- `vetting`: what the engine needs: refuse what cannot be exact, the masks and positions a model takes;
- `reading`: transformers' own loading, quiet and with errors a user can act on;
- `converted`: float32 copies of GGUF files (the embedded model's among them) in the user cache;
- `loading`: a model and its tokenizer by name (nothing, a folder, a .gguf file or a hub id).

Nothing is imported here, so that the engine can import `vetting` without the rest.
"""
