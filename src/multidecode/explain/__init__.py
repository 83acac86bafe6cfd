"""A picture of one verification step, drawn from a real run: the forest and its attention mask.

Speculative decoding here feeds every live branch's newest token with a draft tree under it, all
in one forward over one shared KV cache, and keeps the draft nodes the target itself would have
chosen. This module runs such a decoding (many questions about one document, or any prompts),
watches every step through the scheduler's observer hook, keeps one step, and draws it.

Terms (those of `branches` and `verify`, plus two of the picture's own):

- **step**: one scheduler step, one feed. Step 1 feeds the prompts; every later step feeds each
  live branch's **head** (its newest token) with its **draft** tree under it.
- **accepted** / **rejected**: a draft node on the path the target confirmed, or one taken back
  after the step. The **next token** is the target's own choice after the accepted path: emitted
  in this step, fed as the branch's head in the next one.
- **lane**: one branch in the forest panel: its own prompt tail, its answer so far, then the
  step's nodes, laid out by depth below the head (each one position further), siblings stacked.
- **band**: in the mask panel, a run of adjacent cache slots that every row of the step sees
  alike, drawn as one wider column. Merging them is lossless: a band is all seen or all hidden by
  each row. The shared prefix is one band; so is each branch's stretch of an earlier step.

The step is recorded in the observer callback, after the works settled and before rejected nodes
are dropped (`scheduler.StepTrace`): every fed node still has its slot, parent and position then.
Drawing uses matplotlib's Agg canvas (no window, no global state). Nothing here prints.

- `step`: the recorded step as data (lanes, fed nodes, the mask's rows);
- `record`: running the decoding and recording the step (`explain`, `explain_prompts`);
- `draw`: the picture (`draw`, `save`).
"""

from .draw import draw, save, shown
from .record import (
           EXPLAIN_BUDGET,
           Explanation,
           explain,
           explain_prompts,
           sample_excerpt,
           sample_questions,
           summarize,
           token_text,
)
from .step import FedNode, Lane, StepCounts, StepView

__all__ = ["EXPLAIN_BUDGET", "Explanation", "FedNode", "Lane", "StepCounts", "StepView", "draw", "explain", "explain_prompts",
           "sample_excerpt", "sample_questions", "save", "shown", "summarize", "token_text"]
