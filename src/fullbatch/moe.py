"""Mixture-of-experts losses under accumulation: the load-balancing loss over the window.

A transformers MoE model (Mixtral, Qwen3-MoE, OLMoE) adds ``router_aux_loss_coef`` times
``E · Σ_i f_i · P_i`` to its loss, computed per forward. Under accumulation that is a
different objective per micro-batch; with ``window.stats`` the routing counts ``f`` are the
window's, and each micro-batch adds its own ``P`` term (docs/moe.md)::

    acc = fb.Accumulator(model, opt, micro_batches=4,
                         counts={"tokens": lambda m: fb.count_tokens(m["labels"])})
    k, coef = model.config.num_experts_per_tok, model.config.router_aux_loss_coef

    def routing(m):
        out = model(input_ids=m["input_ids"], attention_mask=m["attention_mask"],
                    output_router_logits=True)
        return fb.moe.router_counts(out.router_logits, top_k=k,
                                    attention_mask=m["attention_mask"])

    for window in acc.windows(loader):
        counts = window.stats(routing)           # once per window, all ranks
        for m in window:
            out = model(input_ids=m["input_ids"], attention_mask=m["attention_mask"],
                        output_router_logits=True)
            ce, _ = fb.causal_lm_loss(out.logits, m["labels"])
            aux = fb.moe.load_balancing(out.router_logits, counts,
                                        attention_mask=m["attention_mask"])
            window.backward(ce / window.totals["tokens"] + coef * aux)
        window.step()
"""

from __future__ import annotations

from fullbatch._base._moe import load_balancing, router_counts

__all__ = ["load_balancing", "router_counts"]
