"""What users ask for, each as a forest over the one engine.

- `ask`: many questions about one document, one branch per question (the seed's main use case).
- `complete`: n completions of one prompt, one prefill, n sampled branches.
- `vote`: parallel reasoning traces and a majority answer (self-consistency).
- `beam`: beam search; beams are branches of one tree, their common history stored once.
- `margins`: writing in the margins (arXiv 2408.14906): a note per chunk of a long context, all
  chunks in one pass, then an answer from the relevant notes.

Each module adds nodes, reads logits and decides which leaves live on through `branches` and the
`Scheduler`; none calls the model itself, and none copies another.
"""
