"""Plain float64 reference implementations of the losses, written from the papers' formulas.

Deliberately naive: a Python loop over anchors, explicit lists of positives and negatives,
``exp`` and ``log`` exactly as printed (no log-sum-exp tricks; float64 holds e^200 easily).
They share no code with ``receipt_embed.losses`` so that agreement means something. All take
unnormalised embeddings and differentiate through autograd.
"""

from __future__ import annotations

import math

import torch


def _unit(x):
    x = x.double()
    return x / x.norm(dim=1, keepdim=True)


def ntxent(x, labels, t):
    """SimCLR NT-Xent; rows [view1; view2]; same-identity non-positives left out."""
    z = _unit(x)
    n = z.shape[0]
    b = n // 2
    labels = labels.tolist()
    losses = []
    for i in range(n):
        p = (i + b) % n
        numerator = torch.exp(z[i] @ z[p] / t)
        denominator = numerator
        for j in range(n):
            if labels[j] != labels[i]:
                denominator = denominator + torch.exp(z[i] @ z[j] / t)
        losses.append(-torch.log(numerator / denominator))
    return torch.stack(losses).mean()


def ntxent_unmasked(x, t):
    """The naive variant: positive by index only, every other row in the denominator --
    a duplicate capture of the anchor's receipt is then treated as a negative."""
    z = _unit(x)
    n = z.shape[0]
    b = n // 2
    losses = []
    for i in range(n):
        p = (i + b) % n
        numerator = torch.exp(z[i] @ z[p] / t)
        denominator = sum(torch.exp(z[i] @ z[j] / t) for j in range(n) if j != i)
        losses.append(-torch.log(numerator / denominator))
    return torch.stack(losses).mean()


def supcon(x, labels, t):
    """Khosla et al. 2020, L_out; returns (loss, number of anchors without positives)."""
    z = _unit(x)
    n = z.shape[0]
    labels = labels.tolist()
    losses, skipped = [], 0
    for i in range(n):
        positives = [p for p in range(n) if p != i and labels[p] == labels[i]]
        if not positives:
            skipped += 1
            continue
        denominator = sum(torch.exp(z[i] @ z[a] / t) for a in range(n) if a != i)
        terms = [-torch.log(torch.exp(z[i] @ z[p] / t) / denominator) for p in positives]
        losses.append(torch.stack(terms).mean())
    return torch.stack(losses).mean(), skipped


def _debiased_anchor(pos, negs, t, tau_plus, beta):
    """Robinson et al.'s estimator (Chuang et al.'s for beta = 0) for one anchor."""
    n = len(negs)
    if n == 0:
        return torch.zeros((), dtype=pos.dtype)  # no negatives: pos / (pos + 0)
    neg = torch.stack(negs)  # exp(s_ij)
    imp = torch.exp(beta * torch.log(neg))  # exp(beta * s_ij)
    reweighted = (imp * neg).sum() / imp.mean()
    ng = (-tau_plus * n * pos + reweighted) / (1 - tau_plus)
    ng = torch.clamp(ng, min=n * math.e ** (-1 / t))
    return -torch.log(pos / (pos + ng))


def hard_negative(x, labels, t, beta, tau_plus):
    z = _unit(x)
    n = z.shape[0]
    b = n // 2
    labels = labels.tolist()
    losses = []
    for i in range(n):
        pos = torch.exp(z[i] @ z[(i + b) % n] / t)
        negs = [torch.exp(z[i] @ z[j] / t) for j in range(n) if labels[j] != labels[i]]
        losses.append(_debiased_anchor(pos, negs, t, tau_plus, beta))
    return torch.stack(losses).mean()


def debiased(x, labels, t, tau_plus):
    return hard_negative(x, labels, t, 0.0, tau_plus)


def moco(q, k, labels, queue, queue_labels, t, in_batch_negatives=False):
    """InfoNCE of q_i against k_i and the queue entries (and batch keys) of other identities."""
    q, k = _unit(q), _unit(k)
    queue = queue.double()
    labels, queue_labels = labels.tolist(), queue_labels.tolist()
    losses = []
    for i in range(q.shape[0]):
        logits = [q[i] @ k[i] / t]
        logits += [q[i] @ queue[j] / t for j in range(queue.shape[0]) if queue_labels[j] != labels[i]]
        if in_batch_negatives:
            logits += [q[i] @ k[j] / t for j in range(k.shape[0]) if labels[j] != labels[i]]
        exps = torch.exp(torch.stack(logits))
        losses.append(-torch.log(exps[0] / exps.sum()))
    return torch.stack(losses).mean()
