//! A pool of KV block ids of one layer kind: reference counts, a free list, and the prefix
//! cache — blocks whose content is known by the hash chain of the tokens up to their end, kept
//! after their last user lets go and handed out again on a hit, evicted least recently freed
//! first when fresh blocks run out.

use std::collections::{BTreeMap, HashMap};

/// What a full block holds: the chain hash of every earlier block and its own token ids.
/// Equal keys mean equal K/V (the tokens and their positions are the same).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) struct BlockKey {
    /// Chain hash of the blocks before it (0 for the first block).
    pub parent: u64,
    /// Its token ids.
    pub tokens: Box<[u32]>,
}

/// Block ids `0..n` with reference counts and a prefix cache.
pub(crate) struct BlockPool {
    refs: Vec<u32>,
    /// The cache key of each block whose content is registered.
    key_of: Vec<Option<BlockKey>>,
    by_key: HashMap<BlockKey, u32>,
    /// Free blocks with no cached content.
    clean: Vec<u32>,
    /// Free blocks with cached content, by the tick they were freed (oldest first).
    cached: BTreeMap<u64, u32>,
    /// The tick each free cached block is filed under.
    freed_at: Vec<u64>,
    tick: u64,
    used: usize,
}

impl BlockPool {
    /// A pool of `n` free blocks.
    pub fn new(n: usize) -> Self {
        BlockPool {
            refs: vec![0; n],
            key_of: vec![None; n],
            by_key: HashMap::new(),
            clean: (0..n as u32).rev().collect(),
            cached: BTreeMap::new(),
            freed_at: vec![0; n],
            tick: 0,
            used: 0,
        }
    }

    /// Blocks in the pool.
    pub fn total(&self) -> usize {
        self.refs.len()
    }

    /// Blocks held by at least one sequence.
    pub fn used(&self) -> usize {
        self.used
    }

    /// A fresh block for one user, evicting the least recently freed cached block when no
    /// clean one is left; `None` when every block is in use.
    pub fn alloc(&mut self) -> Option<u32> {
        let b = match self.clean.pop() {
            Some(b) => b,
            None => {
                let (_, b) = self.cached.pop_first()?;
                if let Some(key) = self.key_of[b as usize].take() {
                    self.by_key.remove(&key);
                }
                b
            }
        };
        self.refs[b as usize] = 1;
        self.used += 1;
        Some(b)
    }

    /// The block registered under `key`, if any (in use or free).
    pub fn lookup(&self, key: &BlockKey) -> Option<u32> {
        self.by_key.get(key).copied()
    }

    /// Adds a user to a block found by [`BlockPool::lookup`].
    pub fn share(&mut self, b: u32) {
        let i = b as usize;
        if self.refs[i] == 0 {
            self.cached.remove(&self.freed_at[i]);
            self.used += 1;
        }
        self.refs[i] += 1;
    }

    /// Drops a user of `b`; the last one makes it free (kept in the cache if registered).
    pub fn release(&mut self, b: u32) {
        let i = b as usize;
        debug_assert!(self.refs[i] > 0, "block {b} released more often than taken");
        self.refs[i] -= 1;
        if self.refs[i] > 0 {
            return;
        }
        self.used -= 1;
        if self.key_of[i].is_some() {
            self.tick += 1;
            self.freed_at[i] = self.tick;
            self.cached.insert(self.tick, b);
        } else {
            self.clean.push(b);
        }
    }

    /// Records that block `b` (in use) holds the content of `key`. A key already held by
    /// another block keeps that one.
    pub fn register(&mut self, b: u32, key: BlockKey) {
        let i = b as usize;
        if self.key_of[i].is_some() || self.by_key.contains_key(&key) {
            return;
        }
        self.by_key.insert(key.clone(), b);
        self.key_of[i] = Some(key);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(parent: u64, t: u32) -> BlockKey {
        BlockKey {
            parent,
            tokens: vec![t, t + 1].into(),
        }
    }

    #[test]
    fn alloc_release_and_exhaustion() {
        let mut p = BlockPool::new(3);
        let a: Vec<u32> = (0..3).map(|_| p.alloc().unwrap()).collect();
        assert_eq!(p.used(), 3);
        assert_eq!(p.alloc(), None);
        let mut sorted = a.clone();
        sorted.sort();
        assert_eq!(sorted, [0, 1, 2]);
        p.release(a[1]);
        assert_eq!(p.used(), 2);
        assert_eq!(p.alloc(), Some(a[1]));
    }

    #[test]
    fn cached_blocks_survive_release_until_evicted_oldest_first() {
        let mut p = BlockPool::new(3);
        let (a, b) = (p.alloc().unwrap(), p.alloc().unwrap());
        p.register(a, key(0, 1));
        p.register(b, key(7, 3));
        p.release(a);
        p.release(b);
        assert_eq!(p.used(), 0);
        // A hit takes the block back out of the free list.
        assert_eq!(p.lookup(&key(7, 3)), Some(b));
        p.share(b);
        assert_eq!(p.used(), 1);
        // Clean blocks go first, then the oldest cached one (a), whose key is forgotten.
        let c = p.alloc().unwrap();
        assert!(c != a && c != b);
        assert_eq!(p.alloc(), Some(a));
        assert_eq!(p.lookup(&key(0, 1)), None);
        assert_eq!(p.alloc(), None);
        // Shared blocks stay until the last user lets go.
        p.share(b);
        p.release(b);
        p.release(b);
        assert_eq!(p.lookup(&key(7, 3)), Some(b));
        assert_eq!(p.used(), 2);
    }

    #[test]
    fn a_key_keeps_its_first_block() {
        let mut p = BlockPool::new(2);
        let (a, b) = (p.alloc().unwrap(), p.alloc().unwrap());
        p.register(a, key(0, 1));
        p.register(b, key(0, 1));
        assert_eq!(p.lookup(&key(0, 1)), Some(a));
        p.release(b);
        // b had no key of its own: it is clean again.
        assert_eq!(p.alloc(), Some(b));
    }
}
