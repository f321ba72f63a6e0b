"""Speculative decoding (vLLM's ``spec_decode``): proposers behind one interface, the draft
budget, verification and the states' rollback.

* ``proposer.py`` -- the ``Proposer`` interface and the registry (``register_proposer``): the
  engine builds the one ``speculative_config.method`` names;
* ``ngram.py`` -- ``ngram``: prompt lookup; ``mtp.py`` -- ``mtp``: the checkpoint's MTP head;
* ``budget.py`` -- ``DraftBudget``: drafts are kept only where they pay for their rows;
* ``verify.py`` -- ``verify``: rejection sampling, exact for every sampling setting.

One step with speculation (engine -> scheduler -> runner -> scheduler):

1. after each step the drafter proposes up to k tokens for every decoding request it may draft
   for (``Proposer.propose`` sets ``Request.draft_ids``): ``NgramProposer`` finds the longest
   suffix of the request's tokens (``prompt_lookup_max`` down to ``prompt_lookup_min``) that
   occurred before and proposes what followed its latest earlier occurrence; ``MtpProposer``
   chains the MTP head k times from the step's hidden states;
2. the scheduler gives such a request a verify chunk ``[last token, d1 .. dk]`` (drafts cut to
   the token budget, the pages, ``max_model_len`` and ``max_tokens``) in the same packed step as
   every other request's prefill chunk or decode;
3. the runner computes logits for all of the chunk's rows; the linear layers capture their
   compact state updates instead of committing (``kernels/capsule.py``); ``verify`` picks the
   tokens: greedy rows accept drafts while they equal the argmax and then add the argmax (so
   the output is exactly greedy decoding's); random rows accept draft ``d`` at row ``i`` with
   probability ``p_i(d)`` (the draft is a point mass) and, at the first rejection, sample from
   ``p_i`` with ``d`` removed (the residual distribution), else a bonus token from the last
   row -- rejection sampling, so every token has exactly the target distribution ``p`` (the
   request's processed, filtered distribution). Each random verify draws its uniforms (one per
   draft, one for the token it samples: ``sampling.draw``) from the request's own generator,
   so seeded runs repeat;
4. the scheduler appends the tokens, and the runner commits the accepted ones' states
   (``PagedHybridCache.commit_verified``; prefix-cache checkpoints inside them are saved
   there). Attention needs no rollback: a rejected token's K/V rows lie past the sequence's
   length and are overwritten.

Requests with penalties, bad words or ``min_tokens`` still to reach are not drafted for (their
processed logits depend on the tokens before each row); they decode as usual in the same steps.
A request under a grammar (``structured_outputs``) is: its drafts are cut where the grammar
would refuse one (``matcher.validate_tokens``), and each row of its verify chunk is masked by
what the grammar allows after the drafts before it (``structured.draft_masks``: consumed
tentatively, rolled back) -- the same masked distribution plain decoding samples from, so
verification stays exact; the matcher then advances by the tokens kept.
"""

from pagedhybrid.engine.spec_decode import mtp, ngram  # noqa: F401  (they register themselves)
from pagedhybrid.engine.spec_decode.budget import DraftBudget
from pagedhybrid.engine.spec_decode.proposer import (
    PROPOSERS,
    Proposer,
    ProposerContext,
    ProposerSpec,
    draftable,
    proposer_spec,
    register_proposer,
)
from pagedhybrid.engine.spec_decode.verify import verify

__all__ = ["PROPOSERS", "DraftBudget", "Proposer", "ProposerContext", "ProposerSpec", "draftable",
           "proposer_spec", "register_proposer", "verify"]
