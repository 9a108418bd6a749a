"""EAGLE-3: the fused low, middle and high streams in, tokens out. The loss is the soft cross-entropy to the
target's distribution over the draft vocabulary (forward KL up to a constant), unrolled by training-time test
(train.ttt.unroll: depth d reads the layer's own output of depth d-1), depth d weighted decay**(d-1); no feature
regression. The head (final norm and lm_head rows) trains with the layer."""
from __future__ import annotations

from runtime.drafters.eagle3 import Eagle3Model, aux_layers
from runtime.drafters.shared.draft_head import DraftHead
from train.recipes import Recipe
from train.recipes.eagle import eagle_loss, simulated_chain


class Eagle3Recipe(Recipe):
    ttt_depth, ttt_decay = 3, 0.8  # where distill.ttt_depth / ttt_decay are None

    def build(self, target, drafter, distill, keep_ids):
        layers = aux_layers(drafter.aux_layers, target.config.n_layers)
        return Eagle3Model.from_target(target, keep_ids, layers).requires_grad_(True).train()

    def target_blocks(self, drafter, n_layers):
        return (n_layers - 1,)  # Eagle3Model.from_target starts from the last block

    def loss(self, target, drafter, distill, keep_ids):
        return eagle_loss(target, noise=0.0, depth=distill.ttt_depth or self.ttt_depth,
                          decay=distill.ttt_decay or self.ttt_decay, w_feature=0.0, w_token=1.0,
                          candidates=distill.token_candidates, goal_head=DraftHead(target.output, keep_ids))

    def evaluator(self, target, val_batch, drafter):
        return lambda model: simulated_chain(model, target, [val_batch], drafter.depth)


RECIPE = Eagle3Recipe()
