"""A torch interpreter of the megakernel's schedule: the same op instances, the same units, the
same buffers and the same dependency rules as csrc/mk/program.cuh, each unit computed with torch.

Two uses:
- `run(order="random")` executes the units of a step in a random order that respects only the
  declared dependencies (program.py). Every scratch buffer starts as NaN, so a dependency the
  schedule forgot makes some unit read unwritten data and the result disagrees with the
  reference: the schedule is checked on the CPU without a GPU.
- `diff_ops()` replays a chain-mode run op by op against a kernel's buffers (GPU or emulation)
  and names the first op whose output disagrees, for debugging a kernel change.
- `run_spec()` executes a spec program (the drafter's pass or the verifier's step, program.py
  build's `spec`) the same way, its speculative ops on a copy of the speculative state (SpecIO,
  abi.py's layouts), so their declared dependencies are checked in random orders too.
"""
from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

import torch

from . import abi, tree as treelib
from .config import ConfigError
from .plan import MOE_COMBINE_COLS
from .program import (DEP_ALL, DEP_LOCAL, DEP_SENTINEL, Program, attn_unit, cached_keys, group_size, n_units,
                      needed_group, splits, unit_group)
from .reference import KVCache, Request, rmsnorm
from .weights import BF16, ModelWeights

F32 = torch.float32


@dataclass
class SpecIO:
    """A spec program's inputs and outputs in the interpreter, in the kernel's layouts (abi.py):
    `state` [n_req, SPEC_INTS] (read and written), `table` the seed table (draft) or the tree table
    (verify), `top2` the draft rows' top-2 (the draft's argmax writes it, the verifier's tree reads it)."""
    state: torch.Tensor
    table: torch.Tensor
    top2: torch.Tensor


class Interpreter:
    def __init__(self, w: ModelWeights, prog: Program, cache: KVCache | list[KVCache]):
        if prog.plan.tp_ranks or prog.plan.launch_ranks > 1:
            # a TP program's units are one rank's and its collectives poll the other ranks' data
            raise ConfigError("the interpreter runs one rank of an unsharded program; a program of ranks "
                              "(Plan.tp_ranks, launch_ranks) runs in the emulation (ranks.RankEngine)")
        if prog.groups > 1:  # one parameter block's buffers: a group's rows would overwrite another's
            raise ConfigError(f"the interpreter runs one row group; a program of {prog.groups} row groups "
                              "runs in the emulation (groups.GroupEngine)")
        self.caches = [cache] if isinstance(cache, KVCache) else list(cache)  # request r's: caches[r]
        self.w, self.prog, self.cache, self.cfg, self.plan = w, prog, self.caches[0], w.cfg, prog.plan
        c, p = self.cfg, self.plan
        tm, dev = c.max_tree, w.device
        nan = lambda *s, dt=F32: torch.full(s, float("nan"), dtype=dt, device=dev)  # noqa: E731
        zi = lambda *s: torch.zeros(s, dtype=torch.int64, device=dev)  # noqa: E731
        self.parts = p.attn_parts
        self.buf = {
            "x": nan(tm, c.d_model), "ss_part": nan(2, tm, c.d_model // 8), "q": nan(tm, c.n_heads, c.head_dim, dt=BF16),
            "att_o": nan(c.n_kv_heads, self.parts, c.group * 16, c.head_dim),
            "att_ml": nan(c.n_kv_heads, self.parts, c.group * 16, 2), "att_out": nan(tm, c.attn_width, dt=BF16),
            "router_logits": nan(tm, c.n_experts), "route_sel": zi(tm, c.top_k), "route_w": nan(tm, c.top_k),
            "route_slot": zi(tm, c.top_k), "route_pos": zi(tm, c.top_k), "slot_expert": zi(p.max_slots),
            "slot_ntok": zi(p.max_slots), "slot_tok": zi(p.max_slots, 16), "n_slots": zi(1),
            "pooled": nan(tm, c.d_pool, dt=BF16), "act": nan(p.max_slots, 16, c.d_expert, dt=BF16),
            "yexp": nan(p.max_slots, 16, c.d_pool, dt=BF16),
            "ypart": nan(p.max_slots, p.fused_parts if p.fused_experts else 1, 16, c.d_pool), "z": nan(tm, c.d_pool, dt=BF16),
            "logits": nan(tm, c.vocab), "amax_val": nan(c.vocab // 16, tm), "amax_idx": zi(c.vocab // 16, tm),
            "out_tokens": zi(tm),
        }

    # ------------------------------------------------------------------ per-op units
    def _norm(self, gain):
        return rmsnorm(self.buf["x"][: self.T], gain, self.cfg.rms_eps)

    def unit(self, op_index: int, u: int) -> None:
        o = self.prog.ops[op_index]
        getattr(self, "_" + o.kind)(o.layer, u)

    def _embed(self, layer, u):
        self.buf["x"][u] = self.w.embed[self.tokens[u]].to(F32)

    def _qkv(self, layer, u):
        c, lw, b = self.cfg, self.w.layers[layer], self.buf
        n = self.plan.tiles["qkv"].rows
        r0, head = n * u, n * u // c.head_dim
        y = self._norm(lw.attn_norm).to(F32) @ lw.wqkv[r0:r0 + n].to(F32).T  # [T, n]
        d0 = r0 % c.head_dim
        if head < c.n_heads + c.n_kv_heads:  # row t at its request's ctx + its depth
            pos = torch.tensor([self.ctxs[q] + d for q, d in zip(self.row_req, self.depth)], device=y.device)
            cs = self.w.rope_cos[pos][:, d0 // 2:d0 // 2 + n // 2]
            sn = self.w.rope_sin[pos][:, d0 // 2:d0 // 2 + n // 2]
            a, bb = y[:, 0::2].clone(), y[:, 1::2].clone()
            y[:, 0::2], y[:, 1::2] = a * cs - bb * sn, a * sn + bb * cs
        y = y.to(BF16)
        if head < c.n_heads:
            b["q"][: self.T, head, d0:d0 + n] = y
        else:
            is_k = head < c.n_heads + c.n_kv_heads
            kvh = head - c.n_heads - (0 if is_k else c.n_kv_heads)
            for q, (r0q, ctx) in enumerate(zip(self.row0, self.ctxs)):  # each request's rows into its cache
                rows = slice(r0q, self.row0[q + 1])
                kc = self.caches[q]
                slots = kc.slot(layer, torch.arange(ctx, ctx + rows.stop - rows.start, device=y.device))
                (kc.k if is_k else kc.v)[layer][kvh, slots, d0:d0 + n] = y[rows]

    def _attn(self, layer, u):
        c, b = self.cfg, self.buf
        kvh, q, split, ns = attn_unit(self.plan, layer, u, self.tree_sizes, self.ctxs)
        ctx, t0, nt, kc = self.ctxs[q], self.row0[q], self.tree_sizes[q], self.caches[q]
        nc = cached_keys(c, layer, ctx)
        allseq = list(range(ctx - nc, ctx + nt))  # the cached keys it sees, then the new ones
        per = -(-len(allseq) // ns)
        seqs = allseq[split * per:(split + 1) * per]
        kg = self.plan.attn_partials_per_split
        mine = [j * 16 + t for j in range(c.group) for t in range(t0, t0 + nt)]  # the request's rows only
        b["att_ml"][kvh, split * kg:(split + 1) * kg, mine, 1] = 0.0  # other key groups: empty partials
        b["att_ml"][kvh, split * kg:(split + 1) * kg, mine, 0] = float("-inf")
        if not seqs:
            return
        dev = b["q"].device
        sl = kc.slot(layer, torch.tensor(seqs, device=dev))
        kk = kc.k[layer][kvh, sl].to(F32)  # [n, hd]
        vv = kc.v[layer][kvh, sl].to(F32)
        pos = [ctx + d for d in self.depth[t0:t0 + nt]]
        for j in range(c.group):
            h = kvh * c.group + j
            qq = b["q"][t0:t0 + nt, h].to(F32)  # [T_q, hd]: the request's rows only
            s = (qq @ kk.T) * (c.head_dim ** -0.5)
            sq = torch.tensor(seqs, device=dev)
            cached = sq < ctx
            pos_t = torch.tensor(pos, device=dev)[:, None]
            win = torch.ones_like(s, dtype=torch.bool) if c.is_global(layer) else sq[None, :] >= pos_t - c.window + 1
            newi = (sq - ctx).clamp(min=0)
            anc = self.anc[q].to(dev)[:, newi]
            mask = torch.where(cached[None, :], win, anc)
            s = s.masked_fill(~mask, float("-inf"))
            m = s.amax(dim=1)
            muse = torch.where(torch.isinf(m), torch.zeros_like(m), m)
            p = torch.exp(s - muse[:, None])
            row = slice(j * 16 + t0, j * 16 + t0 + nt)
            part = split * kg
            b["att_o"][kvh, part, row] = p @ vv
            b["att_ml"][kvh, part, row, 0] = m
            b["att_ml"][kvh, part, row, 1] = p.sum(dim=1)

    def _attn_combine(self, layer, u):
        c, b = self.cfg, self.buf
        h, t = divmod(u, self.T)
        kvh, j = divmod(h, c.group)
        q = self.row_req[t]  # the row's request: its own splits' partials
        n = splits(c, self.plan, layer, self.ctxs[q], self.tree_sizes[q]) * self.plan.attn_partials_per_split
        ml = b["att_ml"][kvh, :n, j * 16 + t]
        o = b["att_o"][kvh, :n, j * 16 + t]
        ok = ml[:, 1] > 0
        if not ok.any():  # the kernel would divide 0 by 0 here
            b["att_out"][t, h * c.head_dim:(h + 1) * c.head_dim] = float("nan")
            return
        mm = ml[ok, 0].max()
        sc = torch.exp(ml[ok, 0] - mm)
        b["att_out"][t, h * c.head_dim:(h + 1) * c.head_dim] = ((sc[:, None] * o[ok]).sum(0) / (sc * ml[ok, 1]).sum()).to(BF16)

    def _oproj(self, layer, u):
        b, n = self.buf, self.plan.tiles["oproj"].rows
        b["x"][: self.T, n * u:n * u + n] += b["att_out"][: self.T].to(F32) @ self.w.layers[layer].wo[n * u:n * u + n].to(F32).T

    def _router(self, layer, u):
        lw, n = self.w.layers[layer], self.plan.tiles["router"].rows
        self.buf["router_logits"][: self.T, n * u:n * u + n] = self._norm(lw.ffn_norm).to(F32) @ lw.router[n * u:n * u + n].to(F32).T

    def _pool(self, layer, u):
        lw, n = self.w.layers[layer], self.plan.tiles["pool"].rows
        self.buf["pooled"][: self.T, n * u:n * u + n] = (self._norm(lw.ffn_norm).to(F32) @ lw.pool[n * u:n * u + n].to(F32).T).to(BF16)

    def _topk(self, layer, u):
        c, b = self.cfg, self.buf
        lg = b["router_logits"][: self.T]
        if self.routes is not None:
            sel = self.routes[layer].to(lg.device).long()
        else:
            sel = torch.sort(lg, dim=-1, descending=True, stable=True).indices[:, : c.top_k]
        w = torch.softmax(lg.gather(1, sel), dim=-1)
        b["route_sel"][: self.T] = sel
        b["route_w"][: self.T] = w
        experts = sorted(set(sel.flatten().tolist()))
        slot = {e: i for i, e in enumerate(experts)}
        ntok = [0] * len(experts)
        for t in range(self.T):
            for r in range(c.top_k):
                s = slot[int(sel[t, r])]
                b["slot_tok"][s, ntok[s]] = t
                b["route_slot"][t, r] = s
                b["route_pos"][t, r] = ntok[s]
                ntok[s] += 1
        b["slot_expert"][: len(experts)] = torch.tensor(experts)
        b["slot_ntok"][: len(experts)] = torch.tensor(ntok)
        b["n_slots"][0] = len(experts)

    def _expert1(self, layer, u):
        c, b, lw = self.cfg, self.buf, self.w.layers[layer]
        h = self.plan.tiles["expert1"].rows // 2
        s, j = divmod(u, c.d_expert // h)
        e, nt = int(b["slot_expert"][s]), int(b["slot_ntok"][s])
        a = b["pooled"][b["slot_tok"][s, :nt]].to(F32)
        w1 = lw.w1.expert(e)
        wd = w1.dequant_bf16_exact()
        rows = list(range(h * j, h * j + h)) + list(range(c.d_expert + h * j, c.d_expert + h * j + h))
        gu = (a @ wd[rows].T) * w1.tensor_scale
        g, up = gu[:, :h], gu[:, h:]
        b["act"][s, :nt, h * j:h * j + h] = (g * (1.0 / (1.0 + torch.exp(-g))) * up).to(BF16)

    def _expert2(self, layer, u):
        c, b, lw = self.cfg, self.buf, self.w.layers[layer]
        if self.plan.fused_experts:  # K-part j of the slot's down projection, all rows, fp32
            h = self.plan.tiles["expert1"].rows // 2
            s, j = divmod(u, c.d_expert // h)
            e, nt = int(b["slot_expert"][s]), int(b["slot_ntok"][s])
            w2 = lw.w2.expert(e)
            a = b["act"][s, :nt, h * j:h * j + h].to(F32)
            b["ypart"][s, j, :nt] = (a @ w2.dequant_bf16_exact()[:, h * j:h * j + h].T) * w2.tensor_scale
            return
        n = self.plan.tiles["expert2"].rows
        s, j = divmod(u, c.d_pool // n)
        e, nt = int(b["slot_expert"][s]), int(b["slot_ntok"][s])
        w2 = lw.w2.expert(e)
        y = (b["act"][s, :nt].to(F32) @ w2.dequant_bf16_exact()[n * j:n * j + n].T) * w2.tensor_scale
        b["yexp"][s, :nt, n * j:n * j + n] = y.to(BF16)

    def _moe_combine(self, layer, u):
        c, b = self.cfg, self.buf
        n = MOE_COMBINE_COLS
        cols = slice(n * u, n * u + n)
        acc = torch.zeros(self.T, n, dtype=F32, device=b["x"].device)
        for r in range(c.top_k):
            s, pos = b["route_slot"][: self.T, r], b["route_pos"][: self.T, r]
            if self.plan.fused_experts:  # the slot's K-parts summed in order, then rounded as y was
                y = b["ypart"][s, 0, pos, cols]
                for j in range(1, self.plan.fused_parts):
                    y = y + b["ypart"][s, j, pos, cols]
                y = y.to(BF16)
            else:
                y = b["yexp"][s, pos, cols]
            acc = acc + b["route_w"][: self.T, r:r + 1] * y.to(F32)
        b["z"][: self.T, cols] = acc.to(BF16)

    def _unpool(self, layer, u):
        b, n = self.buf, self.plan.tiles["unpool"].rows
        b["x"][: self.T, n * u:n * u + n] += b["z"][: self.T].to(F32) @ self.w.layers[layer].unpool[n * u:n * u + n].to(F32).T

    def _lm_head(self, layer, u):
        b = self.buf
        lg = self._norm(self.w.final_norm).to(F32) @ self.w.lm_head[16 * u:16 * u + 16].to(F32).T
        b["logits"][: self.T, 16 * u:16 * u + 16] = lg
        v, i = lg.max(dim=1)  # first maximal index
        b["amax_val"][u, : self.T] = v
        b["amax_idx"][u, : self.T] = i + 16 * u

    def _argmax(self, layer, u):
        b = self.buf
        for t in range(self.T):
            v, i = b["amax_val"][:, t], b["amax_idx"][:, t]
            best = v.max()
            b["out_tokens"][t] = i[v == best].min()
        if getattr(self, "spec", None) is not None and self.prog_spec == "draft":  # (logit desc, index asc)
            self.spec.top2[: self.T] = torch.sort(b["logits"][: self.T], dim=-1, descending=True, stable=True).indices[:, :2]

    # the speculative ops (ops/seed.cuh, tree.cuh, accept.cuh, compact.cuh, advance.cuh)
    def _seed(self, layer, r):
        st, o = self.spec.state, abi.spec_offsets()
        root = int(st[r, o["root"]])
        for j in range(self.tree_sizes[r]):
            self.tokens[self.row0[r] + j] = int(self.spec.table[root, j])

    def _tree(self, layer, r):
        o, st = abi.tree_offsets(), self.spec.state
        n, r0 = self.tree_sizes[r], self.row0[r]
        anc = torch.zeros(n, n, dtype=torch.bool)
        for i in range(n):
            row = self.spec.table[r0 + i]
            d, k = int(row[o["depth"]]), int(row[o["rank"]])
            self.tokens[r0 + i] = int(st[r, abi.spec_offsets()["root"]]) if i == 0 else \
                int(self.spec.top2[r0 - r + d - 1, k])
            self.depth[r0 + i] = d
            anc[i] = torch.tensor([bool((int(row[o["anc"]]) >> j) & 1) for j in range(n)])
        self.anc[r] = anc

    def _accept(self, layer, r):
        o, st = abi.spec_offsets(), self.spec.state
        n, r0 = self.tree_sizes[r], self.row0[r]
        par = [int(self.spec.table[r0 + i, abi.tree_offsets()["parent"]]) for i in range(n)]
        toks, greedy = self.tokens[r0:r0 + n], self.buf["out_tokens"][r0:r0 + n].tolist()
        path, node = [0], 0
        while True:
            nxt = [c for c in range(node + 1, n) if par[c] == node and toks[c] == greedy[node]]
            if not nxt:
                break
            node = nxt[0]
            path.append(node)
        n_out = int(st[r, o["n_out"]])
        active = n_out < int(st[r, o["want"]]) and n_out + n <= abi.MAX_OUT
        st[r, o["path"]:o["path"] + len(path)] = torch.tensor(path)
        st[r, o["len"]] = len(path) if active else 0
        st[r, o["bonus"]] = greedy[node]
        if active:
            emitted = [toks[i] for i in path[1:]] + [greedy[node]]
            st[r, o["out"] + n_out:o["out"] + n_out + len(emitted)] = torch.tensor(emitted)

    def _compact(self, layer, u):
        c, o = self.cfg, abi.spec_offsets()
        nreq = len(self.tree_sizes)
        r, kvh, l = u % nreq, (u // nreq) % c.n_kv_heads, u // (nreq * c.n_kv_heads)
        n = int(self.spec.state[r, o["len"]])
        path = self.spec.state[r, o["path"]:o["path"] + n].tolist()
        kc, ctx = self.caches[r], self.ctxs[r]
        src = torch.tensor([kc.slot(l, ctx + i) for i in path], dtype=torch.long)
        dst = torch.tensor([kc.slot(l, ctx + i) for i in range(n)], dtype=torch.long)
        for t in (kc.k[l], kc.v[l]):
            t[kvh, dst] = t[kvh, src].clone()  # every source row read before any is written

    def _advance(self, layer, u):
        o, st = abi.spec_offsets(), self.spec.state
        for r in range(len(self.tree_sizes)):
            n = int(st[r, o["len"]])
            if n > 0:
                self.ctxs[r] += n
                st[r, o["root"]] = st[r, o["bonus"]]
                st[r, o["n_out"]] += n
                st[r, o["hist"] + n] += 1

    # ------------------------------------------------------------------ executing a step
    def setup(self, tokens, parents, ctx, routes=None):
        self.setup_batch([Request(tokens, parents, ctx)], routes)

    def setup_batch(self, requests, routes=None):
        """A step of these requests (request r on caches[r]); `routes`: per layer [rows, top_k]."""
        if len(requests) > len(self.caches):
            raise ValueError(f"{len(requests)} requests but {len(self.caches)} caches")
        self.tokens, self.depth, self.row_req, self.row0, self.ctxs, self.tree_sizes, self.anc = [], [], [], [0], [], [], []
        for r, q in enumerate(requests):
            toks = [int(x) for x in (q.tokens.tolist() if torch.is_tensor(q.tokens) else q.tokens)]
            self.cfg.check_step(q.ctx, len(toks))
            self.tokens += toks
            self.depth += treelib.depths(q.parents)
            self.anc.append(treelib.ancestor_mask(q.parents))  # [T_r, T_r], the request's own rows
            self.row_req += [r] * len(toks)
            self.row0.append(self.row0[-1] + len(toks))
            self.ctxs.append(int(q.ctx))
            self.tree_sizes.append(len(toks))
        self.T = len(self.tokens)
        if self.T > self.cfg.max_tree:
            raise ValueError(f"{self.T} rows in one step: at most {self.cfg.max_tree}")
        self.routes = routes

    def _units(self, i: int) -> int:
        o = self.prog.ops[i]
        return n_units(self.plan, o.kind, o.layer, self.tree_sizes, self.ctxs, int(self.buf["n_slots"][0]))

    def run(self, tokens, parents, ctx, routes=None, order: str = "random", seed: int = 0,
            program: Program | None = None) -> torch.Tensor:
        """Execute a step unit by unit; `order` "program" (op order) or "random" (any order the
        declared dependencies allow). Returns logits [T, V]."""
        return self.run_batch([Request(tokens, parents, ctx)], routes, order, seed, program)

    def run_batch(self, requests, routes=None, order: str = "random", seed: int = 0,
                  program: Program | None = None) -> torch.Tensor:
        """run() of a step of these requests (request r on caches[r]). Returns logits [rows, V]."""
        self.spec = None
        self.setup_batch(requests, routes)
        return self._execute(program or self.prog, order, seed)

    def run_spec(self, spec: SpecIO, rows: list[int], ctxs: list[int], order: str = "random", seed: int = 0,
                 program: Program | None = None) -> torch.Tensor:
        """A spec program's step (`program`, default this interpreter's, must be one) of requests of
        `rows` rows at contexts `ctxs` (request r on caches[r]); its seed or tree op writes the
        rows' tokens (the drafter's depths and ancestors are its chains), `spec` is read and
        written as the kernel's buffers are. Returns logits [rows, V]; self.ctxs holds the contexts
        after it (the verifier's advance)."""
        prog = program or self.prog
        if prog.spec is None:
            raise ValueError("run_spec: a spec program (program.build's spec) wanted")
        self.spec, self.prog_spec = spec, prog.spec
        chains = [Request([0] * t, treelib.chain(t), c) for t, c in zip(rows, ctxs)]
        self.setup_batch(chains)
        self.tokens = [self.cfg.vocab - 1] * self.T  # the seed / tree op must write them
        if prog.spec == "verify":  # so must the tree op the depths and ancestors
            self.depth = [0] * self.T
            self.anc = [torch.eye(t, dtype=torch.bool) for t in rows]
        return self._execute(prog, order, seed)

    def _execute(self, prog: Program, order: str, seed: int) -> torch.Tensor:
        rng = random.Random(seed)
        n_done = [0] * len(prog.ops)
        group_done: list[dict[int, int]] = [dict() for _ in prog.ops]
        pending: list[list[int] | None] = [None] * len(prog.ops)  # units, once countable

        def complete(i) -> bool:
            return pending[i] is not None and n_done[i] >= self._units(i)

        # launches run in stream order: a dependency on an earlier launch is not declared
        # (program.build), so only the first launch with unfinished units may run
        launch_of = [li for li, (first, n) in enumerate(prog.launches) for _ in range(n)]
        active = 0

        def ready_units(i) -> list[int]:
            o = prog.ops[i]
            units = pending[i]
            if launch_of[i] != active:
                return []
            for d in o.deps:
                p = prog.ops[d.producer]
                if pending[d.producer] is None:
                    return []
                if d.mode in (DEP_ALL, DEP_SENTINEL):  # a sentinel edge still orders the data
                    if not complete(d.producer):
                        return []
                elif d.mode == DEP_LOCAL:  # the producer's unit of the same index
                    units = [u for u in units if u not in pending[d.producer]]
                else:
                    need = group_size(self.plan, p.kind, p.layer, self.tree_sizes, self.ctxs)
                    units = [u for u in units if group_done[d.producer].get(
                        needed_group(self.plan, o.kind, p.kind, o.layer, u, self.tree_sizes, self.ctxs), 0) >= need]
            return units

        def countable(i) -> bool:  # an expert op's unit count is known once top-k (dep 0) is done
            o = prog.ops[i]
            return o.kind not in ("expert1", "expert2") or complete(o.deps[0].producer)

        while True:
            while active < len(prog.launches) and all(
                    complete(k) for k in range(prog.launches[active][0], sum(prog.launches[active]))):
                active += 1
            for i in range(len(prog.ops)):
                if pending[i] is None and countable(i):
                    pending[i] = list(range(self._units(i)))
            ops = [(i, r) for i in range(len(prog.ops)) if pending[i] for r in [ready_units(i)] if r]
            if not ops:
                break
            # a random op with runnable units, then a random one of them (op order when asked)
            i, r = ops[0] if order == "program" else rng.choice(ops)
            u = r[0] if order == "program" else rng.choice(r)
            self.unit(i, u)
            o = prog.ops[i]
            n_done[i] += 1
            g = unit_group(self.plan, o.kind, o.layer, u, self.tree_sizes, self.ctxs)
            if g is not None:
                group_done[i][g] = group_done[i].get(g, 0) + 1
            pending[i].remove(u)
        left = [prog.ops[i].kind for i in range(len(prog.ops)) if pending[i] is None or pending[i]]
        if left:
            raise RuntimeError(f"schedule stuck: units of {left[:5]} never became ready")
        return self.buf["logits"][: self.T].clone()

    def diff_ops(self, run_op: Callable[[int], dict[str, torch.Tensor]], tokens, parents, ctx, routes=None,
                 rel: float = 2e-2) -> list[tuple[int, str, str, float]]:
        """Op-by-op comparison with a kernel: `run_op(i)` runs op instance i in the kernel (chain
        mode) and returns its buffers; after each op the interpreter runs the same op and the
        buffers it writes are compared (relative L2); the kernel's values are then adopted so the
        next op starts from the same inputs. Returns [(op index, op, buffer, rel error)] of
        mismatches (empty = every op agrees)."""
        self.setup(tokens, parents, ctx, routes)
        writes = {"embed": ["x"], "qkv": ["q"], "attn": [],
                  "attn_combine": ["att_out"], "oproj": ["x"],
                  "router": ["router_logits"], "pool": ["pooled"], "topk": ["route_w", "n_slots"],
                  "expert1": [], "expert2": [], "moe_combine": ["z"], "unpool": ["x"], "lm_head": ["logits"],
                  "argmax": ["out_tokens"]}
        bad = []
        for i, o in enumerate(self.prog.ops):
            kb = run_op(i)
            for u in range(self._units(i)):
                self.unit(i, u)
            for name in writes[o.kind]:
                a, r = kb[name][: self.T].double().cpu(), self.buf[name][: self.T].double().cpu()
                err = float((a - r).norm() / r.norm().clamp_min(1e-30)) if r.numel() else 0.0
                if not err <= rel:
                    bad.append((i, f"{o.kind}(L{o.layer})", name, err))
            for name, t in kb.items():  # adopt the kernel's state
                self.buf[name].copy_(t.to(self.buf[name].device).to(self.buf[name].dtype))
        return bad

