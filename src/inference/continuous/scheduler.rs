//! The continuous-batching scheduler: which requests run this step, how many tokens
//! each, who is admitted and who is preempted. Pure bookkeeping over token ids and block
//! ids: no model, no tensors, no threads, so it is tested with made-up requests.
//!
//! Every request is a token sequence (prompt, then generated tokens) of which the first
//! `computed` have their keys and values in the request's blocks. A step gives each
//! running request the tokens it still needs: one for a decoding request (its last
//! sampled token), a chunk of its prompt for one being prefilled. When a request's
//! computed tokens catch up with its sequence, the executor samples its next token.
//!
//! - **Admission** (tenants in turn, first come first served within a tenant; preempted
//!   requests first) reserves the blocks of the whole prompt, minus the blocks found in
//!   the prefix cache, never `max_tokens` ahead.
//! - **Growth**: a decoding request takes a new block when it crosses a block boundary.
//! - **Preemption**: when no block is left, the most recently admitted running request
//!   gives all of its blocks back and returns to the head of the queue; it is recomputed
//!   later from its tokens so far (its sampled tokens are kept, so its output is exactly
//!   what it would have been).
//! - **Speculation**: a decoding request may carry proposed tokens
//!   ([`Scheduler::propose`]); its row then runs its last token and the proposals (one
//!   more chunk of the running row), with blocks for them taken only from free ones (a
//!   proposal never preempts anyone). How many of a step's proposals run is decided
//!   for the whole step by [`allocate`]: each row's acceptance rate against a cost
//!   model of the step, so a large batch verifies only near-certain proposals. After verification, [`Scheduler::accept_drafts`]
//!   keeps the accepted positions and gives back the blocks only rejected ones used.

use std::collections::{HashMap, VecDeque};

use crate::cache::blocks::{BlockId, BlockManager, PrefixHash};
use crate::speculative::{Candidate, allocate};

/// An engine-assigned request id.
pub type RequestId = u64;

/// Limits of one scheduling step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SchedulerLimits {
    /// Most requests admitted at once (decoding or being prefilled).
    pub max_running: usize,
    /// Tokens per step: one per decoding request, the rest for prompt chunks.
    pub step_tokens: usize,
    /// Smallest prompt budget per step, so prompts progress even with a full batch.
    pub min_prefill_chunk: usize,
}

/// A request as the scheduler sees it.
#[derive(Debug, Clone)]
pub struct Sequence {
    /// The request's id.
    pub id: RequestId,
    /// Prompt tokens followed by generated tokens.
    pub tokens: Vec<u32>,
    /// Tokens whose keys and values are in `blocks`.
    pub computed: usize,
    /// The block table: token `i` lives in `blocks[i / block_size]`.
    pub blocks: Vec<BlockId>,
    /// Full blocks already offered to the prefix cache, and the hash chain up to them.
    registered: (usize, PrefixHash),
    /// The request's prefix-cache partition (the start of its hash chain).
    salt: PrefixHash,
    /// Its tenant, for round-robin admission.
    tenant: u64,
    /// Preempted (it goes back in before anyone else).
    preempted: bool,
    /// Proposed tokens to verify after the pending one in the next step.
    drafts: Vec<u32>,
    /// How [`allocate`] weighs them (the request's acceptance rate and step cost).
    draft_weight: Candidate,
}

impl Sequence {
    /// Tokens still to compute before the next token can be sampled.
    fn pending(&self) -> usize {
        self.tokens.len() - self.computed
    }
}

/// One request's share of a step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ScheduledRow {
    /// The request.
    pub id: RequestId,
    /// First token to compute (tokens before it are in the request's blocks).
    pub start: usize,
    /// Tokens to compute.
    pub len: usize,
    /// Whether the step completes the sequence, so a token is sampled from its logits.
    pub sample: bool,
    /// Proposed tokens run after the sequence's pending token (`len` counts them): the
    /// logits of each of the row's positions are wanted, for verification.
    pub drafts: usize,
}

/// What the scheduler decided for one step.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StepPlan {
    /// Rows to run, decoding requests first (oldest first), then prompt chunks.
    pub rows: Vec<ScheduledRow>,
    /// Requests admitted this step.
    pub admitted: Vec<RequestId>,
    /// Requests preempted this step (back in the queue).
    pub preempted: Vec<RequestId>,
}

impl StepPlan {
    /// Tokens computed by the step.
    pub fn tokens(&self) -> usize {
        self.rows.iter().map(|r| r.len).sum()
    }
}

/// The scheduler and the block manager it allocates from.
#[derive(Debug, Clone)]
pub struct Scheduler {
    limits: SchedulerLimits,
    blocks: BlockManager,
    waiting: VecDeque<Sequence>,
    /// Admitted requests, oldest admission first.
    running: Vec<Sequence>,
    preemptions: u64,
    /// When each tenant with a request waiting or running was last admitted (an
    /// admission counter), for round-robin admission.
    last_admitted: HashMap<u64, u64>,
    admissions: u64,
}

impl Scheduler {
    /// A scheduler over `blocks`.
    pub fn new(limits: SchedulerLimits, blocks: BlockManager) -> Self {
        Self {
            limits,
            blocks,
            waiting: VecDeque::new(),
            running: Vec::new(),
            preemptions: 0,
            last_admitted: HashMap::new(),
            admissions: 0,
        }
    }

    /// The block manager (for metrics).
    pub fn blocks(&self) -> &BlockManager {
        &self.blocks
    }

    /// The block manager, to change: blocks registered by the engine's persistence,
    /// never those of a running request.
    pub fn blocks_mut(&mut self) -> &mut BlockManager {
        &mut self.blocks
    }

    /// Requests waiting for admission.
    pub fn waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Admitted requests that are decoding (their prompt is done).
    pub fn decoding(&self) -> usize {
        self.running.iter().filter(|s| s.pending() <= 1).count()
    }

    /// Admitted requests whose prompt is still being processed.
    pub fn prefilling(&self) -> usize {
        self.running.len() - self.decoding()
    }

    /// Requests preempted so far.
    pub fn preemptions(&self) -> u64 {
        self.preemptions
    }

    /// Whether no request is waiting or admitted.
    pub fn is_idle(&self) -> bool {
        self.waiting.is_empty() && self.running.is_empty()
    }

    /// Ids of every request the scheduler holds.
    pub fn ids(&self) -> Vec<RequestId> {
        self.running
            .iter()
            .chain(&self.waiting)
            .map(|s| s.id)
            .collect()
    }

    /// An admitted request.
    pub fn running(&self, id: RequestId) -> Option<&Sequence> {
        self.running.iter().find(|s| s.id == id)
    }

    /// Whether a request of `tokens` tokens (prompt plus `max_tokens`) can ever run: it
    /// must fit the pool on its own.
    pub fn fits(&self, tokens: usize) -> bool {
        self.blocks.blocks_for(tokens) <= self.blocks.total_blocks()
    }

    /// Queues a request with its prompt.
    pub fn add(&mut self, id: RequestId, prompt: Vec<u32>) {
        self.add_salted(id, prompt, 0);
    }

    /// Queues a request whose prefix-cache partition is `salt`: it reuses only blocks
    /// computed by requests with the same salt (see
    /// [`BlockManager::match_prefix_salted`]).
    pub fn add_salted(&mut self, id: RequestId, prompt: Vec<u32>, salt: PrefixHash) {
        self.add_for(id, prompt, salt, 0);
    }

    /// Queues a request of `tenant` in prefix-cache partition `salt`. Admission takes
    /// tenants in turn: the next request admitted is the oldest of the tenant admitted
    /// least recently (preempted requests first of all), so one tenant's burst cannot
    /// hold the others back. With one tenant this is first come, first served.
    pub fn add_for(&mut self, id: RequestId, prompt: Vec<u32>, salt: PrefixHash, tenant: u64) {
        self.last_admitted.entry(tenant).or_insert(0);
        self.waiting.push_back(Sequence {
            id,
            tokens: prompt,
            computed: 0,
            blocks: Vec::new(),
            registered: (0, salt),
            salt,
            tenant,
            preempted: false,
            drafts: Vec::new(),
            draft_weight: Candidate {
                proposed: 0,
                rate: 0.0,
                overhead: 0.0,
            },
        });
    }

    /// The position in the queue of the next request to admit: a preempted one if any
    /// (they are at the front), else the oldest request of the tenant admitted least
    /// recently.
    fn next_admission(&self) -> Option<usize> {
        let front = self.waiting.front()?;
        if front.preempted {
            return Some(0);
        }
        let turn = |s: &Sequence| self.last_admitted.get(&s.tenant).copied().unwrap_or(0);
        self.waiting
            .iter()
            .enumerate()
            .min_by_key(|&(i, s)| (turn(s), i))
            .map(|(i, _)| i)
    }

    /// Forgets the tenants with nothing waiting or running (bounds the table).
    fn forget_idle_tenants(&mut self) {
        if self.last_admitted.len() > self.waiting.len() + self.running.len() {
            let (waiting, running) = (&self.waiting, &self.running);
            self.last_admitted
                .retain(|t, _| waiting.iter().chain(running).any(|s| s.tenant == *t));
        }
    }

    /// Removes a request wherever it is, freeing its blocks. Returns whether it was held.
    pub fn finish(&mut self, id: RequestId) -> bool {
        if let Some(i) = self.running.iter().position(|s| s.id == id) {
            let seq = self.running.remove(i);
            self.blocks.free(&seq.blocks);
            return true;
        }
        if let Some(i) = self.waiting.iter().position(|s| s.id == id) {
            self.waiting.remove(i);
            return true;
        }
        false
    }

    /// Decides the next step.
    pub fn schedule(&mut self) -> StepPlan {
        let mut plan = StepPlan::default();
        // 1. Decoding requests, oldest first: one token each, a new block at a boundary.
        let mut i = 0;
        while i < self.running.len() {
            if self.running[i].pending() != 1 {
                i += 1;
                continue;
            }
            if !self.grow(i, &mut plan) {
                // It preempted itself: it was the newest.
                continue;
            }
            let seq = &self.running[i];
            plan.rows.push(ScheduledRow {
                id: seq.id,
                start: seq.computed,
                len: 1,
                sample: true,
                drafts: 0,
            });
            i += 1;
        }
        // 2. Their proposals: those worth verifying in this step, within the step's
        //    tokens left after one per running request, and the free blocks.
        self.plan_drafts(&mut plan);
        let decoding = plan.tokens();
        let mut budget = self
            .limits
            .step_tokens
            .saturating_sub(decoding)
            .max(self.limits.min_prefill_chunk);
        // 3. Prompts already admitted (their blocks are reserved), oldest first.
        for seq in &self.running {
            if budget == 0 {
                break;
            }
            let pending = seq.pending();
            if pending <= 1 {
                continue;
            }
            let len = pending.min(budget);
            budget -= len;
            plan.rows.push(ScheduledRow {
                id: seq.id,
                start: seq.computed,
                len,
                sample: len == pending,
                drafts: 0,
            });
        }
        // 3. Admissions, tenants in turn, while the step has budget.
        self.forget_idle_tenants();
        while budget > 0 && self.running.len() < self.limits.max_running {
            let Some(next) = self.next_admission() else {
                break;
            };
            let seq = &self.waiting[next];
            let hit = self.blocks.match_prefix_salted(&seq.tokens, seq.salt);
            let needed = self.blocks.blocks_for(seq.tokens.len()) - hit.blocks.len();
            let Some(fresh) = self.blocks.allocate(needed) else {
                self.blocks.unmatch(&hit);
                break;
            };
            let Some(mut seq) = self.waiting.remove(next) else {
                break;
            };
            self.admissions += 1;
            self.last_admitted.insert(seq.tenant, self.admissions);
            seq.preempted = false;
            seq.computed = hit.tokens;
            seq.blocks = hit.blocks;
            seq.blocks.extend(fresh);
            seq.registered = (0, seq.salt);
            let pending = seq.pending();
            let len = pending.min(budget);
            budget -= len;
            plan.admitted.push(seq.id);
            plan.rows.push(ScheduledRow {
                id: seq.id,
                start: seq.computed,
                len,
                sample: len == pending,
                drafts: 0,
            });
            self.running.push(seq);
        }
        plan
    }

    /// Makes sure running request `i` has a block for one more token, preempting the
    /// newest requests if the pool is full. Returns false if request `i` itself was
    /// preempted.
    fn grow(&mut self, i: usize, plan: &mut StepPlan) -> bool {
        loop {
            let seq = &self.running[i];
            if seq.computed < seq.blocks.len() * self.blocks.block_size() {
                return true;
            }
            if let Some(block) = self.blocks.allocate(1) {
                self.running[i].blocks.extend(block);
                return true;
            }
            let victim = self.running.len() - 1;
            self.preempt(victim, plan);
            if victim == i {
                return false;
            }
        }
    }

    /// Sets the proposals of the plan's decoding rows: [`allocate`] picks how many of
    /// each row's are worth verifying, then free blocks must hold them.
    fn plan_drafts(&mut self, plan: &mut StepPlan) {
        let budget = self.limits.step_tokens.saturating_sub(self.running.len());
        let rows: Vec<(usize, usize)> = plan
            .rows
            .iter()
            .enumerate()
            .filter_map(|(r, row)| Some((r, self.running.iter().position(|s| s.id == row.id)?)))
            .collect();
        let candidates: Vec<Candidate> = rows
            .iter()
            .map(|&(_, i)| {
                let seq = &self.running[i];
                Candidate {
                    proposed: seq.drafts.len(),
                    ..seq.draft_weight
                }
            })
            .collect();
        if candidates.iter().all(|c| c.proposed == 0) {
            return;
        }
        let counts = allocate(&candidates, plan.rows.len(), budget);
        for (&(r, i), count) in rows.iter().zip(counts) {
            let drafts = self.grow_for_drafts(i, count);
            plan.rows[r].len = 1 + drafts;
            plan.rows[r].drafts = drafts;
        }
    }

    /// Keeps as many of running request `i`'s proposals (at most `budget`) as free
    /// blocks can hold after its pending token, taking those blocks; drops the rest.
    /// Returns how many it keeps.
    fn grow_for_drafts(&mut self, i: usize, budget: usize) -> usize {
        let bs = self.blocks.block_size();
        let seq = &mut self.running[i];
        seq.drafts.truncate(budget);
        while !seq.drafts.is_empty() {
            let end = seq.computed + 1 + seq.drafts.len();
            let missing = end.div_ceil(bs).saturating_sub(seq.blocks.len());
            if missing == 0 {
                break;
            }
            if let Some(blocks) = self.blocks.allocate(missing) {
                seq.blocks.extend(blocks);
                break;
            }
            // Not enough free blocks: fewer proposals.
            let fit = (seq.blocks.len() * bs).saturating_sub(seq.computed + 1);
            seq.drafts.truncate(fit.min(seq.drafts.len() - 1));
        }
        seq.drafts.len()
    }

    /// Sets running request `id`'s proposals for the next step, weighed as `weight`
    /// says (its `proposed` is ignored): kept only while it is decoding (one pending
    /// token).
    pub fn propose(&mut self, id: RequestId, drafts: Vec<u32>, weight: Candidate) {
        if let Some(seq) = self.running.iter_mut().find(|s| s.id == id)
            && seq.pending() == 1
        {
            seq.drafts = drafts;
            seq.draft_weight = weight;
        }
    }

    /// The proposals of running request `id` in the step being run.
    pub fn drafts(&self, id: RequestId) -> &[u32] {
        self.running
            .iter()
            .find(|s| s.id == id)
            .map_or(&[], |s| s.drafts.as_slice())
    }

    /// Records that `accepted` of running request `id`'s proposals were accepted (its
    /// sampled tokens appended already): their keys and values stay computed, and the
    /// blocks only rejected positions used go back to the pool.
    pub fn accept_drafts(&mut self, id: RequestId, accepted: usize) {
        let bs = self.blocks.block_size();
        let Some(seq) = self.running.iter_mut().find(|s| s.id == id) else {
            return;
        };
        seq.computed = (seq.computed + accepted).min(seq.tokens.len());
        let keep = seq.tokens.len().div_ceil(bs);
        if seq.blocks.len() > keep {
            let freed = seq.blocks.split_off(keep);
            self.blocks.free(&freed);
        }
        let (from, parent) = seq.registered;
        seq.registered =
            self.blocks
                .register_full_blocks(&seq.tokens, &seq.blocks, seq.computed, from, parent);
    }

    /// Frees request `i`'s blocks and puts it back at the head of the queue.
    fn preempt(&mut self, i: usize, plan: &mut StepPlan) {
        let mut seq = self.running.remove(i);
        seq.drafts.clear();
        self.blocks.free(&seq.blocks);
        seq.blocks.clear();
        seq.computed = 0;
        seq.registered = (0, seq.salt);
        seq.preempted = true;
        plan.preempted.push(seq.id);
        plan.rows.retain(|r| r.id != seq.id);
        self.preemptions += 1;
        self.waiting.push_front(seq);
    }

    /// Records that the plan's rows ran: their tokens are computed, and newly full
    /// blocks are offered to the prefix cache.
    pub fn complete(&mut self, plan: &StepPlan) {
        for row in &plan.rows {
            let Some(seq) = self.running.iter_mut().find(|s| s.id == row.id) else {
                continue;
            };
            // Proposals are not the sequence's tokens: verification decides.
            seq.computed = (row.start + row.len).min(seq.tokens.len());
            seq.drafts.clear();
            let (from, parent) = seq.registered;
            seq.registered = self.blocks.register_full_blocks(
                &seq.tokens,
                &seq.blocks,
                seq.computed,
                from,
                parent,
            );
        }
    }

    /// Appends a sampled token to a running request.
    pub fn append(&mut self, id: RequestId, token: u32) {
        if let Some(seq) = self.running.iter_mut().find(|s| s.id == id) {
            seq.tokens.push(token);
        }
    }

    /// Checks the block accounting against the requests' tables. For tests.
    pub fn check_invariants(&self) -> std::result::Result<(), String> {
        self.blocks.check_invariants()?;
        let held: usize = self.running.iter().map(|s| s.blocks.len()).sum();
        if self.blocks.prefix_caching() {
            if held < self.blocks.in_use() {
                return Err(format!(
                    "{} blocks in use but tables hold {held}",
                    self.blocks.in_use()
                ));
            }
        } else if held != self.blocks.in_use() {
            return Err(format!(
                "{} blocks in use but tables hold {held}",
                self.blocks.in_use()
            ));
        }
        if self.waiting.iter().any(|s| !s.blocks.is_empty()) {
            return Err("a waiting request holds blocks".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(max_running: usize, step_tokens: usize) -> SchedulerLimits {
        SchedulerLimits {
            max_running,
            step_tokens,
            min_prefill_chunk: 4,
        }
    }

    fn prompt(n: usize, base: u32) -> Vec<u32> {
        (0..n as u32).map(|i| base + i).collect()
    }

    /// Runs a plan as the executor would: every sampled row gets token 7.
    fn run(s: &mut Scheduler, plan: &StepPlan) {
        s.complete(plan);
        for row in plan.rows.iter().filter(|r| r.sample) {
            s.append(row.id, 7);
        }
        s.check_invariants().unwrap();
    }

    #[test]
    fn prompts_are_chunked_and_decoders_go_first() {
        let mut s = Scheduler::new(limits(8, 10), BlockManager::new(64, 4, false));
        s.add(1, prompt(6, 0));
        s.add(2, prompt(25, 100));
        let plan = s.schedule();
        assert_eq!(plan.admitted, vec![1, 2]);
        assert_eq!(
            plan.rows,
            vec![
                ScheduledRow {
                    id: 1,
                    start: 0,
                    len: 6,
                    sample: true,
                    drafts: 0
                },
                ScheduledRow {
                    id: 2,
                    start: 0,
                    len: 4,
                    sample: false,
                    drafts: 0
                },
            ]
        );
        run(&mut s, &plan);
        // Request 1 decodes (1 token); request 2 gets the other 9 of the 10.
        let plan = s.schedule();
        assert_eq!(
            plan.rows,
            vec![
                ScheduledRow {
                    id: 1,
                    start: 6,
                    len: 1,
                    sample: true,
                    drafts: 0
                },
                ScheduledRow {
                    id: 2,
                    start: 4,
                    len: 9,
                    sample: false,
                    drafts: 0
                },
            ]
        );
        run(&mut s, &plan);
        let plan = s.schedule();
        assert_eq!(
            plan.rows[1],
            ScheduledRow {
                id: 2,
                start: 13,
                len: 9,
                sample: false,
                drafts: 0
            }
        );
        run(&mut s, &plan);
        let plan = s.schedule();
        assert_eq!(
            plan.rows[1],
            ScheduledRow {
                id: 2,
                start: 22,
                len: 3,
                sample: true,
                drafts: 0
            }
        );
        run(&mut s, &plan);
        assert_eq!((s.decoding(), s.prefilling()), (2, 0));
    }

    #[test]
    fn admission_reserves_the_prompt_not_max_tokens_and_rows_grow_by_blocks() {
        let mut s = Scheduler::new(limits(8, 64), BlockManager::new(16, 4, false));
        s.add(1, prompt(5, 0));
        let plan = s.schedule();
        run(&mut s, &plan);
        assert_eq!(s.running(1).unwrap().blocks.len(), 2, "5 tokens: 2 blocks");
        assert_eq!(s.blocks().in_use(), 2);
        // Tokens 6, 7, 8 fit block 2; the ninth token needs a third block.
        for expected in [2, 2, 2, 3] {
            let plan = s.schedule();
            assert_eq!(s.running(1).unwrap().blocks.len(), expected);
            run(&mut s, &plan);
        }
    }

    #[test]
    fn a_full_queue_waits_at_admission() {
        let mut s = Scheduler::new(limits(8, 64), BlockManager::new(4, 4, false));
        s.add(1, prompt(12, 0)); // 3 blocks
        s.add(2, prompt(8, 50)); // 2 blocks: does not fit beside request 1
        let plan = s.schedule();
        assert_eq!(plan.admitted, vec![1]);
        assert_eq!(s.waiting(), 1);
        run(&mut s, &plan);
        s.finish(1);
        let plan = s.schedule();
        assert_eq!(plan.admitted, vec![2]);
        s.check_invariants().unwrap();
    }

    #[test]
    fn the_newest_request_is_preempted_and_recomputed_with_its_tokens() {
        let mut s = Scheduler::new(limits(8, 64), BlockManager::new(4, 4, false));
        s.add(1, prompt(4, 0)); // one full block
        s.add(2, prompt(8, 50)); // two full blocks
        let plan = s.schedule();
        assert_eq!(plan.admitted, vec![1, 2]);
        run(&mut s, &plan);
        // Both need a new block for their next token; one block is free. Request 1 (the
        // oldest) takes it, request 2 must make room: it is preempted.
        let plan = s.schedule();
        assert_eq!(plan.preempted, vec![2]);
        assert_eq!(plan.rows.len(), 1);
        assert_eq!(plan.rows[0].id, 1);
        assert_eq!(s.preemptions(), 1);
        assert_eq!(s.waiting(), 1);
        run(&mut s, &plan);
        s.finish(1);
        // Back at the head of the queue, recomputed with its sampled token: 9 tokens.
        let plan = s.schedule();
        assert_eq!(plan.admitted, vec![2]);
        assert_eq!(
            plan.rows,
            vec![ScheduledRow {
                id: 2,
                start: 0,
                len: 9,
                sample: true,
                drafts: 0
            }]
        );
        assert_eq!(s.running(2).unwrap().tokens.len(), 9);
        run(&mut s, &plan);
    }

    #[test]
    fn a_request_alone_in_a_full_pool_preempts_itself_without_looping() {
        let mut s = Scheduler::new(limits(8, 64), BlockManager::new(2, 2, false));
        s.add(1, prompt(2, 0));
        s.add(2, prompt(2, 10));
        let plan = s.schedule();
        run(&mut s, &plan);
        // Both hold one full block and both need a second: request 2 goes back, request 1
        // takes its block.
        let plan = s.schedule();
        assert_eq!(plan.preempted, vec![2]);
        assert_eq!(plan.rows.len(), 1);
        run(&mut s, &plan);
        // Its fourth token still fits the second block.
        let plan = s.schedule();
        assert!(plan.preempted.is_empty());
        run(&mut s, &plan);
        // Request 1 has 4 tokens computed in 2 blocks; its fifth needs a third block that
        // does not exist: it preempts itself (the engine refuses such requests up front).
        let plan = s.schedule();
        assert_eq!(plan.preempted, vec![1]);
        assert!(plan.rows.iter().all(|r| r.id != 1));
        s.check_invariants().unwrap();
    }

    #[test]
    fn a_shared_prefix_is_computed_once() {
        let mut s = Scheduler::new(limits(8, 64), BlockManager::new(16, 4, true));
        let system = prompt(8, 0);
        let mut a = system.clone();
        a.extend([100, 101, 102]);
        s.add(1, a);
        let plan = s.schedule();
        run(&mut s, &plan);
        let mut b = system.clone();
        b.extend([200, 201]);
        s.add(2, b);
        let plan = s.schedule();
        let row = *plan.rows.iter().find(|r| r.id == 2).unwrap();
        assert_eq!(
            (row.start, row.len),
            (8, 2),
            "only the question is computed"
        );
        assert_eq!(s.blocks().hit_tokens(), 8);
        let shared = &s.running(1).unwrap().blocks[..2];
        assert_eq!(&s.running(2).unwrap().blocks[..2], shared);
        run(&mut s, &plan);
        s.finish(1);
        s.finish(2);
        assert_eq!(s.blocks().in_use(), 0);
        s.check_invariants().unwrap();
    }

    #[test]
    fn salted_requests_share_prefixes_only_within_their_salt() {
        let mut s = Scheduler::new(limits(8, 64), BlockManager::new(32, 4, true));
        let document = prompt(8, 0);
        let with_question = |q: u32| {
            let mut p = document.clone();
            p.push(q);
            p
        };
        s.add_salted(1, with_question(100), 11);
        let plan = s.schedule();
        run(&mut s, &plan);
        // Another salt (and the unsalted partition) computes the document again.
        s.add_salted(2, with_question(101), 22);
        s.add(3, with_question(102));
        let plan = s.schedule();
        run(&mut s, &plan);
        assert_eq!(s.blocks().hit_tokens(), 0, "no hit across salts");
        let start = |plan: &StepPlan, id| plan.rows.iter().find(|r| r.id == id).unwrap().start;
        assert_eq!(start(&plan, 2), 0);
        assert_eq!(start(&plan, 3), 0);
        // The same salt reuses it.
        s.add_salted(4, with_question(103), 11);
        let plan = s.schedule();
        assert_eq!(start(&plan, 4), 8, "a hit within the salt");
        assert_eq!(s.blocks().hit_tokens(), 8);
        run(&mut s, &plan);
        for id in 1..=4 {
            s.finish(id);
        }
        assert_eq!(s.blocks().in_use(), 0);
        s.check_invariants().unwrap();
    }

    #[test]
    fn admission_takes_tenants_in_turn() {
        let mut s = Scheduler::new(limits(2, 64), BlockManager::new(64, 4, false));
        // Tenant 1's burst of 6, then tenant 2's and tenant 3's one request each.
        for id in 0..6 {
            s.add_for(id, prompt(3, id as u32 * 10), 0, 1);
        }
        s.add_for(6, prompt(3, 60), 0, 2);
        s.add_for(7, prompt(3, 70), 0, 3);
        let plan = s.schedule();
        // One request of each tenant in turn, not tenant 1's whole burst first.
        assert_eq!(plan.admitted, vec![0, 6]);
        run(&mut s, &plan);
        s.finish(0);
        s.finish(6);
        let plan = s.schedule();
        assert_eq!(plan.admitted, vec![7, 1], "tenant 3, then tenant 1 again");
        run(&mut s, &plan);
        s.finish(7);
        s.add_for(8, prompt(3, 80), 0, 2);
        let plan = s.schedule();
        assert_eq!(
            plan.admitted,
            vec![8],
            "tenant 2's turn before tenant 1's next"
        );
        s.check_invariants().unwrap();
    }

    #[test]
    fn proposals_run_as_the_step_cost_model_allows() {
        let weight = |rate| Candidate {
            proposed: 0,
            rate,
            overhead: 2.0,
        };
        // Sixteen decoding rows; proposals are planned only where they pay.
        let mut s = Scheduler::new(limits(32, 256), BlockManager::new(256, 4, false));
        for id in 0..16 {
            s.add(id, prompt(3, 10 * id as u32));
        }
        let plan = s.schedule();
        run(&mut s, &plan);
        for id in 0..16 {
            s.propose(id, vec![1, 2, 3, 4, 5, 6, 7, 8], weight(0.5));
        }
        s.propose(3, vec![1, 2, 3, 4, 5, 6, 7, 8], weight(0.99));
        let plan = s.schedule();
        assert_eq!(plan.rows.len(), 16);
        for row in &plan.rows {
            assert_eq!(row.len, 1 + row.drafts);
            if row.id == 3 {
                assert!(row.drafts >= 4, "{row:?}");
                assert_eq!(s.drafts(3).len(), row.drafts);
            } else {
                assert_eq!(row.drafts, 0, "{row:?}");
            }
        }
        s.check_invariants().unwrap();
        // The accepted proposals stay computed; the blocks of rejected ones go back.
        s.complete(&plan);
        for row in plan.rows.iter().filter(|r| r.id != 3) {
            s.append(row.id, 7);
        }
        for t in [1, 2, 9] {
            s.append(3, t);
        }
        s.accept_drafts(3, 2);
        s.check_invariants().unwrap();
        assert_eq!(
            s.running(3).map(|q| (q.computed, q.tokens.len())),
            Some((6, 7))
        );

        // One row alone: a coin-flip proposer gets one position, a copier several.
        let mut s = Scheduler::new(limits(4, 64), BlockManager::new(64, 4, false));
        s.add(1, prompt(3, 0));
        let plan = s.schedule();
        run(&mut s, &plan);
        s.propose(1, vec![5; 8], weight(0.5));
        assert_eq!(s.schedule().rows[0].drafts, 1);
        let mut s = Scheduler::new(limits(4, 64), BlockManager::new(64, 4, false));
        s.add(1, prompt(3, 0));
        let plan = s.schedule();
        run(&mut s, &plan);
        s.propose(1, vec![5; 8], weight(0.9));
        assert_eq!(s.schedule().rows[0].drafts, 5);
    }

    #[test]
    fn max_running_caps_admission() {
        let mut s = Scheduler::new(limits(2, 64), BlockManager::new(64, 4, false));
        for id in 0..5 {
            s.add(id, prompt(3, id as u32 * 10));
        }
        let plan = s.schedule();
        assert_eq!(plan.admitted, vec![0, 1]);
        assert_eq!(s.waiting(), 3);
        run(&mut s, &plan);
        s.finish(0);
        let plan = s.schedule();
        assert_eq!(plan.admitted, vec![2]);
    }

    #[test]
    fn finishing_a_waiting_or_running_request_frees_everything() {
        let mut s = Scheduler::new(limits(1, 64), BlockManager::new(8, 4, false));
        s.add(1, prompt(6, 0));
        s.add(2, prompt(6, 0));
        let plan = s.schedule();
        run(&mut s, &plan);
        assert!(s.finish(2), "waiting request");
        assert!(s.finish(1), "running request");
        assert!(!s.finish(1));
        assert!(s.is_idle());
        assert_eq!(s.blocks().in_use(), 0);
        s.check_invariants().unwrap();
    }

    #[test]
    fn random_workloads_keep_the_accounting_exact() {
        use rand::{Rng, SeedableRng, rngs::StdRng};
        let mut rng = StdRng::seed_from_u64(7);
        for caching in [false, true] {
            let mut s = Scheduler::new(limits(6, 24), BlockManager::new(20, 4, caching));
            let mut budgets = std::collections::HashMap::new();
            let mut next = 0u64;
            for _ in 0..400 {
                if rng.random_bool(0.3) {
                    let len = rng.random_range(1..20);
                    let base = rng.random_range(0..3) * 1000;
                    s.add(next, prompt(len, base));
                    budgets.insert(next, rng.random_range(1..10usize));
                    next += 1;
                }
                let plan = s.schedule();
                assert!(plan.tokens() <= 24 + 6, "{plan:?}");
                s.complete(&plan);
                for row in plan.rows.iter().filter(|r| r.sample) {
                    s.append(row.id, 7);
                    let left = budgets.get_mut(&row.id).unwrap();
                    *left -= 1;
                    if *left == 0 {
                        s.finish(row.id);
                    }
                }
                if rng.random_bool(0.05)
                    && let Some(&id) = s.ids().first()
                {
                    s.finish(id);
                }
                s.check_invariants().unwrap();
            }
            for id in s.ids() {
                s.finish(id);
            }
            assert_eq!(s.blocks().in_use(), 0);
            s.check_invariants().unwrap();
        }
    }
}
