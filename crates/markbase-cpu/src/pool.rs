//! A persistent thread pool with a cheap parallel-for.
//!
//! Workers are started once ([`Pool::new`]) and live as long as the pool. [`Pool::run`] hands
//! out task indices `0..tasks` through one atomic word; the calling thread works too, so a
//! pool of `threads` threads starts `threads - 1` workers. Between jobs a worker spins for a
//! short while (the next operation of a forward pass usually follows within microseconds),
//! then sleeps on a condition variable until the next job.
//!
//! The caller waits for the job's *tasks*, never for the workers: a worker that is slow to
//! wake (or descheduled on a busy machine) simply finds no task left, and the caller has done
//! them. The atomic word packs the job's epoch, its task count and the next task index, so a
//! claim is one compare-and-swap that can only succeed for the job the worker has read.
//!
//! Each task index runs exactly once, on some thread; callers that write disjoint outputs per
//! task therefore get results that do not depend on the number of threads.

use std::cell::Cell;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use markbase_core::{Error, Result};

/// How long an idle worker spins before it goes to sleep.
const SPIN: Duration = Duration::from_micros(300);
/// Bits of the task count and of the next index in the state word (the epoch takes the rest).
const INDEX_BITS: u32 = 20;
/// Largest task count of one [`Pool::run`] call.
const MAX_TASKS: usize = (1 << INDEX_BITS) - 1;
const INDEX_MASK: u64 = (1 << INDEX_BITS) - 1;

/// A job: the task body, lifetime erased (see the safety note in [`Pool::run`]).
type Job = &'static (dyn Fn(usize) + Sync);

thread_local! {
    /// Set while this thread runs tasks of a job (nested `run` calls then run inline).
    static IN_JOB: Cell<bool> = const { Cell::new(false) };
}

/// `(epoch, tasks, next)` packed in one word.
fn pack(epoch: u64, tasks: usize, next: usize) -> u64 {
    (epoch << (2 * INDEX_BITS)) | ((tasks as u64) << INDEX_BITS) | next as u64
}

fn epoch_of(state: u64) -> u64 {
    state >> (2 * INDEX_BITS)
}

/// State shared by the caller and the workers.
struct Shared {
    /// The current job's data and vtable pointers (a fat pointer in two words, so a worker
    /// can read it while the next job is being written; it only calls it after a claim).
    job: [AtomicUsize; 2],
    /// Epoch, task count and next task index of the current job.
    state: AtomicU64,
    /// Tasks of the current job finished.
    done: AtomicUsize,
    /// Workers asleep (or about to sleep) on `wake`.
    sleepers: AtomicUsize,
    /// Set when a task panicked; the caller re-raises it.
    panicked: AtomicBool,
    /// Set when the pool is dropped.
    stop: AtomicBool,
    /// Sleep/wake for idle workers.
    lock: Mutex<()>,
    wake: Condvar,
}

impl Shared {
    /// Claims and runs tasks of the job with `epoch`, read as `job` words, until none are
    /// left.
    fn run_tasks(&self, epoch: u64, job: [usize; 2]) {
        IN_JOB.with(|c| c.set(true));
        loop {
            let cur = self.state.load(Ordering::Acquire);
            let (tasks, next) = ((cur >> INDEX_BITS) & INDEX_MASK, cur & INDEX_MASK);
            if epoch_of(cur) != epoch || next >= tasks {
                break;
            }
            if self
                .state
                .compare_exchange_weak(cur, cur + 1, Ordering::AcqRel, Ordering::Relaxed)
                .is_err()
            {
                continue;
            }
            // SAFETY: the claim succeeded, so the job of `epoch` is live and not finished, and
            // the words read after seeing `epoch` are its own: the next job's words are
            // written only after every task of this one has finished (see `Pool::run`).
            let f = unsafe { std::mem::transmute::<[usize; 2], Job>(job) };
            if catch_unwind(AssertUnwindSafe(|| f(next as usize))).is_err() {
                self.panicked.store(true, Ordering::Relaxed);
            }
            self.done.fetch_add(1, Ordering::Release);
        }
        IN_JOB.with(|c| c.set(false));
    }

    /// The words of the job as last written.
    fn job(&self) -> [usize; 2] {
        [
            self.job[0].load(Ordering::Relaxed),
            self.job[1].load(Ordering::Relaxed),
        ]
    }
}

/// A fixed set of threads running parallel-for jobs.
pub struct Pool {
    shared: Arc<Shared>,
    workers: Vec<JoinHandle<()>>,
    /// Serialises jobs from several caller threads.
    submit: Mutex<()>,
}

impl Pool {
    /// A pool of `threads` threads in all, the caller included (0 = one per core).
    pub fn new(threads: usize) -> Result<Pool> {
        let threads = if threads == 0 {
            std::thread::available_parallelism().map_or(1, |n| n.get())
        } else {
            threads
        };
        let shared = Arc::new(Shared {
            job: [AtomicUsize::new(0), AtomicUsize::new(0)],
            state: AtomicU64::new(0),
            done: AtomicUsize::new(0),
            sleepers: AtomicUsize::new(0),
            panicked: AtomicBool::new(false),
            stop: AtomicBool::new(false),
            lock: Mutex::new(()),
            wake: Condvar::new(),
        });
        let mut workers = Vec::with_capacity(threads - 1);
        for i in 1..threads {
            let s = Arc::clone(&shared);
            let handle = std::thread::Builder::new()
                .name(format!("markbase-cpu-{i}"))
                .spawn(move || worker(&s))
                .map_err(|e| Error::Invalid(format!("cannot start CPU thread {i}: {e}")))?;
            workers.push(handle);
        }
        Ok(Pool {
            shared,
            workers,
            submit: Mutex::new(()),
        })
    }

    /// Threads in the pool, the caller included.
    pub fn threads(&self) -> usize {
        self.workers.len() + 1
    }

    /// Runs `f(i)` for every `i` in `0..tasks`, spread over the pool's threads, and returns
    /// when all have finished. Runs inline when there is one task or one thread, or when called
    /// from inside a task. A panic in a task is re-raised here after the job has finished.
    ///
    /// # Panics
    /// If `tasks` exceeds 2^20 − 1 (a caller bug: jobs are split into far fewer tasks).
    pub fn run(&self, tasks: usize, f: &(dyn Fn(usize) + Sync)) {
        assert!(tasks <= MAX_TASKS, "{tasks} tasks in one pool job");
        if tasks == 0 {
            return;
        }
        if tasks == 1 || self.workers.is_empty() || IN_JOB.with(Cell::get) {
            (0..tasks).for_each(f);
            return;
        }
        let guard = self.submit.lock().unwrap_or_else(|e| e.into_inner());
        let s = &*self.shared;
        // The job is shared as the two words of its fat pointer, lifetime erased: a worker
        // calls it only after claiming one of its tasks, and claims stop succeeding once all
        // tasks are claimed; this function returns only after every task has finished, so `f`
        // outlives every call. The next job overwrites these words only after that point too.
        // SAFETY: a `&dyn Fn` is two words; they are turned back into one only as above.
        let parts = unsafe { std::mem::transmute::<&(dyn Fn(usize) + Sync), [usize; 2]>(f) };
        s.job[0].store(parts[0], Ordering::Relaxed);
        s.job[1].store(parts[1], Ordering::Relaxed);
        s.done.store(0, Ordering::Relaxed);
        let epoch = (epoch_of(s.state.load(Ordering::Relaxed)) + 1) & ((1 << 24) - 1);
        s.state.store(pack(epoch, tasks, 0), Ordering::SeqCst);
        if s.sleepers.load(Ordering::SeqCst) > 0 {
            let _l = s.lock.lock().unwrap_or_else(|e| e.into_inner());
            s.wake.notify_all();
        }
        s.run_tasks(epoch, parts);
        let mut spins = 0u32;
        while s.done.load(Ordering::Acquire) != tasks {
            spins += 1;
            if spins < 1 << 12 {
                std::hint::spin_loop();
            } else {
                // A worker holding the last task may have been descheduled.
                std::thread::yield_now();
            }
        }
        drop(guard);
        if s.panicked.swap(false, Ordering::Relaxed) {
            panic!("a task of a CPU thread-pool job panicked");
        }
    }
}

impl Pool {
    /// Runs `f(i, chunk)` over the consecutive `chunk_len`-long chunks of `data` (the last may
    /// be shorter), `i` being the chunk's index, spread over the pool.
    pub fn par_chunks_mut<T: Send>(
        &self,
        data: &mut [T],
        chunk_len: usize,
        f: impl Fn(usize, &mut [T]) + Sync,
    ) {
        let chunk_len = chunk_len.max(1);
        let (len, base) = (data.len(), SendPtr(data.as_mut_ptr()));
        self.run(len.div_ceil(chunk_len), &|i| {
            let start = i * chunk_len;
            let n = chunk_len.min(len - start);
            // SAFETY: chunks are disjoint and inside `data`, which outlives the job.
            let chunk = unsafe { std::slice::from_raw_parts_mut(base.get().add(start), n) };
            f(i, chunk)
        });
    }
}

/// A raw pointer that tasks writing disjoint parts of one buffer may share.
pub(crate) struct SendPtr<T>(pub *mut T);

impl<T> Clone for SendPtr<T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T> Copy for SendPtr<T> {}

impl<T> SendPtr<T> {
    /// The pointer (a method, so closures capture the whole `Send` wrapper).
    pub fn get(self) -> *mut T {
        self.0
    }
}

// SAFETY: users only write disjoint elements through it while the owner waits.
unsafe impl<T: Send> Send for SendPtr<T> {}
unsafe impl<T: Send> Sync for SendPtr<T> {}

impl Drop for Pool {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        {
            let _l = self.shared.lock.lock().unwrap_or_else(|e| e.into_inner());
            self.shared.wake.notify_all();
        }
        for w in self.workers.drain(..) {
            let _ = w.join();
        }
    }
}

/// A worker thread: wait for a new epoch, run what is left of its tasks.
fn worker(s: &Shared) {
    let mut seen = epoch_of(s.state.load(Ordering::Acquire));
    loop {
        let start = Instant::now();
        let mut spins = 0u32;
        loop {
            if s.stop.load(Ordering::Relaxed) {
                return;
            }
            let e = epoch_of(s.state.load(Ordering::Acquire));
            if e != seen {
                seen = e;
                break;
            }
            spins = spins.wrapping_add(1);
            if !spins.is_multiple_of(64) || start.elapsed() < SPIN {
                std::hint::spin_loop();
                continue;
            }
            let mut l = s.lock.lock().unwrap_or_else(|e| e.into_inner());
            s.sleepers.fetch_add(1, Ordering::SeqCst);
            while epoch_of(s.state.load(Ordering::SeqCst)) == seen && !s.stop.load(Ordering::SeqCst)
            {
                l = s.wake.wait(l).unwrap_or_else(|e| e.into_inner());
            }
            s.sleepers.fetch_sub(1, Ordering::SeqCst);
        }
        s.run_tasks(seen, s.job());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_task_runs_once_on_any_thread_count() {
        for threads in [1, 2, 3, 5] {
            let pool = Pool::new(threads).unwrap();
            assert_eq!(pool.threads(), threads);
            for tasks in [0, 1, 2, 7, 1000] {
                let hits: Vec<AtomicUsize> = (0..tasks).map(|_| AtomicUsize::new(0)).collect();
                pool.run(tasks, &|i| {
                    hits[i].fetch_add(1, Ordering::Relaxed);
                });
                assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1));
            }
        }
    }

    #[test]
    fn many_small_jobs_in_a_row_lose_no_task() {
        let pool = Pool::new(3).unwrap();
        let total = AtomicUsize::new(0);
        for job in 0..20_000 {
            let tasks = 2 + job % 5;
            pool.run(tasks, &|i| {
                total.fetch_add(i + 1, Ordering::Relaxed);
            });
        }
        let want: usize = (0..20_000).map(|j| (2 + j % 5) * (3 + j % 5) / 2).sum();
        assert_eq!(total.load(Ordering::Relaxed), want);
    }

    #[test]
    fn sleeping_workers_wake_for_the_next_job() {
        let pool = Pool::new(3).unwrap();
        std::thread::sleep(SPIN * 4);
        let sum = AtomicUsize::new(0);
        pool.run(64, &|i| {
            sum.fetch_add(i, Ordering::Relaxed);
        });
        assert_eq!(sum.load(Ordering::Relaxed), 64 * 63 / 2);
    }

    #[test]
    fn nested_runs_execute_inline() {
        let pool = Pool::new(2).unwrap();
        let count = AtomicUsize::new(0);
        pool.run(4, &|_| {
            pool.run(3, &|_| {
                count.fetch_add(1, Ordering::Relaxed);
            })
        });
        assert_eq!(count.load(Ordering::Relaxed), 12);
    }

    #[test]
    fn a_panicking_task_is_reraised_and_the_pool_still_works() {
        let pool = Pool::new(2).unwrap();
        let r = catch_unwind(AssertUnwindSafe(|| {
            pool.run(8, &|i| assert!(i != 5, "task 5 fails"));
        }));
        assert!(r.is_err());
        let count = AtomicUsize::new(0);
        pool.run(8, &|_| {
            count.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(count.load(Ordering::Relaxed), 8);
    }
}
