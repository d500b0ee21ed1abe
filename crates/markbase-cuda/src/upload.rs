//! Host index arrays (token ids, positions, KV slots) copied to the device, the last few kept:
//! every layer of a step passes the same positions and slots again, and a repeat costs no copy.
//! Stream order makes reuse safe: a new copy into an entry runs after every kernel queued
//! earlier that reads the entry's old contents.

use std::sync::Arc;

use cudarc::driver::CudaStream;
use markbase_core::Result;

use crate::buffer::Growable;
use crate::device::driver_err;

/// Distinct arrays kept on the device.
const ENTRIES: usize = 8;

struct Entry {
    host: Vec<u32>,
    mem: Growable<u32>,
    ptr: u64,
    used: u64,
}

/// The most recently uploaded index arrays.
pub(crate) struct IndexCache {
    entries: Vec<Entry>,
    tick: u64,
}

impl IndexCache {
    pub(crate) fn new() -> Self {
        IndexCache {
            entries: Vec::with_capacity(ENTRIES),
            tick: 0,
        }
    }

    /// The device address of a copy of `v` (queued now unless an identical copy is kept).
    pub(crate) fn upload(&mut self, stream: &Arc<CudaStream>, v: &[u32]) -> Result<u64> {
        self.tick += 1;
        if let Some(e) = self.entries.iter_mut().find(|e| e.host == v) {
            e.used = self.tick;
            return Ok(e.ptr);
        }
        if self.entries.len() < ENTRIES {
            self.entries.push(Entry {
                host: Vec::new(),
                mem: Growable::new(),
                ptr: 0,
                used: 0,
            });
        }
        let e = self
            .entries
            .iter_mut()
            .min_by_key(|e| e.used)
            .expect("at least one entry");
        e.ptr = e.mem.get(stream, v.len())?;
        if let Some(dst) = e.mem.slice_mut() {
            let mut view = dst.slice_mut(0..v.len());
            stream
                .memcpy_htod(v, &mut view)
                .map_err(|err| driver_err("index upload", err))?;
        }
        e.host.clear();
        e.host.extend_from_slice(v);
        e.used = self.tick;
        Ok(e.ptr)
    }
}
