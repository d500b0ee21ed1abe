//! Products of a few token rows on the tensor cores (kernels/mmq.cu): Q4_K, Q5_K, Q6_K, Q8_0,
//! Q4_0 and Q5_0 weights (rows of whole 256-value units) of 2–128 token rows, dequantized to
//! f16 in registers, on the f16 rounded copy of the activations (past 64 rows, in runs of 64
//! rows, each reading the weights: `plan`).
//! The weights stream once a launch: of up to 32 token rows (4 n-tiles of 8, two blocks a
//! multiprocessor), or of 33–64 in one launch of 8 n-tiles (a block a multiprocessor) where its
//! tiles split their units fewer than `WIDE_SPLITS` ways — else 32 rows a launch, and one
//! matrix of more than 48 rows goes to cuBLAS. Up to `MAX_PRODUCTS` matrices of one width take
//! one launch, or a gated pair (gate and up) whose launch stores gelu_tanh(gate) · up as the
//! 16-bit activations of the down product. Warps walk row tiles of 16 rows; matrices of few
//! tiles split their units over several items a tile, whose parts the tile's last warp adds in
//! order (a ticket a tile in `tickets`).

use markbase_core::quant::GgmlType;
use markbase_core::{Error, Result};

use crate::backend::{int, CudaBackend, Scratch};
use crate::buffer::CudaMatrix;
use crate::kernels::{Arg, Grid, ProductArgs};
use crate::sources::{define_number, Module, DEFINES_VAR};

/// Token rows for which a product of Q4_K or Q8_0 weights runs here rather than as GEMVs
/// (fewer) or as cuBLAS on weights dequantized to f16 (more). Measured on the H200
/// (`bench -p 0 -n 32`, docs/perf.md sessions 31–33), E4B Q4_K: 2 / 3 / 4 / 8 / 16 / 32
/// sequences 581 / 684 / 761 / 861 / 887 / 3 176 t/s before, 647 / 936 / 1 242 / 2 255 /
/// 3 602 / 4 838 here (session 31), and with the gated pair in one launch and the split parts
/// added in parallel 8 / 16 / 32 sequences 2 196 / 3 567 / 4 838 → 2 434 / 3 918 / 5 564. E4B
/// Q8_0 (session 33): 8 / 16 / 32 / 48 sequences 817 / 846 / 3 318 / 4 946 → 2 261 / 3 705 /
/// 5 414 / 5 015. 33–64 rows: see `WIDE_SPLITS`; 65–128 rows: see `plan`.
const MMQ_TOKENS: std::ops::RangeInclusive<usize> = 2..=128;
/// Token rows up to which one matrix alone runs here where its launch of 8 n-tiles is declined
/// (`WIDE_SPLITS`): as launches of 32 rows, each reading the weights, 40 / 48 sequences ran
/// 3 870 / 4 663 t/s on cuBLAS → 4 755 / 5 227 here, but 64 sequences 6 088 → 5 693 (session
/// 32). Several matrices in one launch (q, k, v) run here up to 64 rows either way: cuBLAS
/// multiplies each apart (E4B's q, k and v at 64 rows: Q4_K 81.1 → 29.0 µs, session 38).
const ALONE_TOKENS: usize = 48;
/// Token rows of a launch of 4 n-tiles (`mmq_<format>_4`).
const LAUNCH_TOKENS: usize = 32;
/// Splits of a tile's units from which a launch of 8 n-tiles (33–64 rows) is declined: its
/// warps are 8 a multiprocessor, and with many splits a tile's parts and their fix-up cost
/// more than the launch saves. H200, `cuda_bench --gemv --tokens 64`, E4B Q4_K (8 n-tiles
/// against the launches of 32 rows or cuBLAS before; µs): q/k/v 28.7 → 23.1 (5 splits), q
/// alone 26.3 → 21.9 (5), o 20.5 → 19.9 (4), gate + up 83.0 → 63.9 (2), PLE projection 18.3 →
/// 9.0 (1), but down 52.0 → 70.3 (8) and the PLE gate 22.8 → 29.0 (10); 48 tokens: q/k/v 24.3
/// → 19.8, gate + up 67.9 → 58.1. `bench -p 0 -n 32`, E4B Q4_K_M: 40 / 48 / 64 sequences
/// 4 529 / 4 977 / 6 334 → 4 829 / 5 371 / 7 236 t/s, Q4_0 at 64 6 890 → 7 714 (docs/perf.md
/// session 39). With the item ends lean and the split length balanced (`Tuning::DEFAULT`),
/// 24: down and the PLE gate then run here too (session 44).
const WIDE_SPLITS: usize = 24;
/// Warps of a block.
const BLOCK_WARPS: usize = 8;
/// Most dynamic shared memory of a block of 4 n-tiles or fewer (a split's activations): two
/// blocks fit a multiprocessor.
const MAX_SHARED: usize = 100 << 10;
/// Most dynamic shared memory of a block of 8 n-tiles (a block a multiprocessor): 5 units of
/// 64 tokens' activations.
const WIDE_SHARED: usize = 200 << 10;
/// Most dynamic shared memory of a block of 8 n-tiles where two share a multiprocessor
/// (`Tuning::wide_blocks` 2): 3 units of 64 tokens' activations (108 KB; Hopper's 228 KB a
/// multiprocessor hold two, with 1 KB reserved a block).
const WIDE_SHARED_TWO: usize = 110 << 10;
/// Row tiles whose launches may split their units: one ticket each.
pub(crate) const TICKETS: usize = 1 << 16;
/// Items (a row tile over a split) a launch aims for a multiprocessor: matrices of fewer row
/// tiles split their units until they have that many, one a warp. 16 made E4B Q4_K's
/// 8-sequence step 15 % slower (the parts' fix-up), 4 up to 4 % slower (docs/perf.md
/// session 31).
const ITEMS_PER_SM: usize = 8;
/// Blocks resident on a multiprocessor of launches of 4 n-tiles or fewer
/// (`__launch_bounds__(256, 2)`; 8 n-tiles: `Tuning::wide_blocks`).
const BLOCKS_PER_SM: usize = 2;

/// How the launches are shaped: those of 8 n-tiles (33–64 token rows), and the items rule of
/// those of fewer. The defaults are the measured ones; `MARKBASE_CUDA_DEFINES` may set each
/// (the define named on each field) for a sweep on a GPU — the kernels read `MMQ_WIDE_BLOCKS`
/// too (their register cap).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Tuning {
    /// Items a launch of 4 n-tiles or fewer aims for a multiprocessor (`MMQ_ITEMS`,
    /// `ITEMS_PER_SM`).
    items: usize,
    /// Blocks resident on a multiprocessor (`MMQ_WIDE_BLOCKS`): 1 (`WIDE_SHARED`; registers
    /// as `wide_warps` allow) or 2 (up to 128 registers a thread, `WIDE_SHARED_TWO`).
    wide_blocks: usize,
    /// Warps of a block where `shape` takes them (`MMQ_WIDE_WARPS`): with one block a
    /// multiprocessor 12, 8 or 16 (up to 168, 255 or 128 registers a thread, the block's
    /// activations shared by its warps); with two, `BLOCK_WARPS`.
    wide_warps: usize,
    /// Whether blocks of `wide_warps` warps go wherever `wide_pays` estimates them the
    /// faster and they split a tile's units no more ways than blocks of `BLOCK_WARPS`
    /// (`MMQ_WIDE_PAYS` 1) rather than only to launches they spread over every multiprocessor
    /// (0, session 49's rule).
    wide_when_faster: bool,
    /// Items a launch aims for a multiprocessor where it splits by `ITEMS_PER_SM`'s rule
    /// (`MMQ_WIDE_ITEMS`).
    wide_items: usize,
    /// Splits from which a launch is declined (`MMQ_WIDE_SPLITS`, `WIDE_SPLITS`).
    wide_splits: usize,
    /// Whether a launch takes, instead of the items rule, the split length that gives its
    /// busiest warp the least work (`busiest_work`; fewer splits on a tie) of those splitting
    /// fewer than `wide_splits` ways (`MMQ_WIDE_BALANCE` 1).
    balance: bool,
    /// What an item's end costs the balance, in tenths of a unit (`MMQ_WIDE_ITEM_END`;
    /// `busiest_work`).
    item_end: usize,
}

impl Tuning {
    /// The measured shape rules (docs/perf.md sessions 31–47): the split length balanced ran
    /// E4B Q4_K_M's 64-sequence step at 8 721 / 8 773 t/s on the H100, against 8 169 / 8 337
    /// with the items rule, and 6 732 / 6 958 before the item ends were lean (session 44); an
    /// item's end counted as half a unit, not a whole one, 9 006 / 9 013 against 8 887 /
    /// 8 799 (session 46); one block a multiprocessor for 33–64 rows, not two, 9 934 / 10 049
    /// against 8 624 / 9 051 (fewer splits and parts; session 47); blocks of 12 warps where
    /// they fill every multiprocessor, not 8, 10 762–10 777 against 10 139–10 147 (session 49);
    /// and where `wide_pays` estimates them the faster (down too), on the H200 11 327 / 11 474
    /// against 10 973 / 10 941 (session 50, o then taking them too in 8 splits, its product
    /// 10.6 → 11.8 µs: no more splits than 8 warps' since; so refined, on the H100 11 252 /
    /// 11 279 against 10 745 / 10 743, session 51).
    pub(crate) const DEFAULT: Tuning = Tuning {
        items: ITEMS_PER_SM,
        wide_blocks: 1,
        wide_warps: 12,
        wide_when_faster: true,
        wide_items: ITEMS_PER_SM,
        wide_splits: WIDE_SPLITS,
        balance: true,
        item_end: 5,
    };

    /// The defaults with what `MARKBASE_CUDA_DEFINES` sets; an error names a value out of
    /// range.
    pub(crate) fn from_env() -> Result<Tuning> {
        Tuning::from_defines(&crate::sources::defines_from_env()?)
    }

    /// The defaults with what the `#define` lines `defines` set.
    fn from_defines(defines: &str) -> Result<Tuning> {
        let get = |name: &str, lo: usize, hi: usize, default: usize| {
            define_number(defines, name, (lo, hi), default)
        };
        let d = Tuning::DEFAULT;
        let wide_blocks = get("MMQ_WIDE_BLOCKS", 1, 2, d.wide_blocks)?;
        let warps_by_default = if wide_blocks == 1 {
            d.wide_warps
        } else {
            BLOCK_WARPS
        };
        let wide_warps = get("MMQ_WIDE_WARPS", BLOCK_WARPS, 16, warps_by_default)?;
        if !wide_warps.is_multiple_of(4) || (wide_warps > BLOCK_WARPS && wide_blocks > 1) {
            return Err(Error::Invalid(format!(
                "{DEFINES_VAR}: MMQ_WIDE_WARPS={wide_warps} MMQ_WIDE_BLOCKS={wide_blocks}: a \
                 block's warps are {BLOCK_WARPS}, or 12 or 16 with one block a multiprocessor"
            )));
        }
        Ok(Tuning {
            items: get("MMQ_ITEMS", 1, 64, d.items)?,
            wide_blocks,
            wide_warps,
            wide_when_faster: get("MMQ_WIDE_PAYS", 0, 1, d.wide_when_faster.into())? == 1,
            wide_items: get("MMQ_WIDE_ITEMS", 1, 64, d.wide_items)?,
            wide_splits: get("MMQ_WIDE_SPLITS", 2, 64, d.wide_splits)?,
            balance: get("MMQ_WIDE_BALANCE", 0, 1, d.balance.into())? == 1,
            item_end: get("MMQ_WIDE_ITEM_END", 0, 40, d.item_end)?,
        })
    }

    /// Blocks of a launch of `nt` n-tiles resident on a multiprocessor.
    fn blocks_per_sm(&self, nt: usize) -> usize {
        if nt > 4 {
            self.wide_blocks
        } else {
            BLOCKS_PER_SM
        }
    }

    /// Warps of a block of a launch of `nt` n-tiles.
    fn block_warps(&self, nt: usize) -> usize {
        if nt > 4 {
            self.wide_warps
        } else {
            BLOCK_WARPS
        }
    }

    /// Most dynamic shared memory of a block of `nt` n-tiles.
    fn max_shared(&self, nt: usize) -> usize {
        match (nt > 4, self.wide_blocks) {
            (false, _) => MAX_SHARED,
            (true, 1) => WIDE_SHARED,
            (true, _) => WIDE_SHARED_TWO,
        }
    }
}

/// How the kernels of a weight format cut a row (mmq.cu's `MmqK`, `MmqQ6k`, `MmqQ8_0`,
/// `MmqLegacy`).
struct Format {
    /// Values a unit covers (`F::K`).
    unit: usize,
    /// Shared memory a token's unit of activations takes (`F::TOKEN_BYTES`).
    token_bytes: usize,
    /// The most n-tiles of 8 tokens a kernel takes.
    most_nt: usize,
}

/// The kernels' cut of rows stored as `ty`, for the formats they take.
fn format(ty: GgmlType) -> Option<Format> {
    match ty {
        // A super-block (Q6_K's as laid out on the device), a regrouped group of 8 blocks
        // (Q8_0; Q4_0 and Q5_0 laid out: layout.rs): the same activation slots.
        GgmlType::Q4_K
        | GgmlType::Q5_K
        | GgmlType::Q6_K
        | GgmlType::Q8_0
        | GgmlType::Q4_0
        | GgmlType::Q5_0 => Some(Format {
            unit: 256,
            token_bytes: 576,
            most_nt: 8,
        }),
        _ => None,
    }
}

/// Whether a product of `n` token rows with weights stored as `ty`, rows `cols` wide, may run
/// here (where the device and the launch's shape allow, `CudaBackend::mmq_takes_products`
/// says): a format of the kernels, rows of whole units, `mmq_rows`.
pub fn mma_suits(ty: GgmlType, cols: usize, n: usize) -> bool {
    format(ty).is_some_and(|f| cols.is_multiple_of(f.unit)) && mmq_rows(n)
}

/// Whether products of `n` token rows may run here where their format and width do
/// (`mma_suits`).
pub(crate) fn mmq_rows(n: usize) -> bool {
    MMQ_TOKENS.contains(&n)
}

/// How a launch covers its matrices' `tiles` row tiles: `nt` n-tiles of 8 tokens, each tile's
/// units in `splits` runs of `per_split`, `blocks` blocks of `warps` warps a split.
#[derive(Debug, PartialEq, Eq)]
struct Shape {
    nt: usize,
    splits: usize,
    per_split: usize,
    blocks: usize,
    warps: usize,
}

impl Shape {
    /// Dynamic shared memory of a block: its split's activations.
    fn shared(&self, f: &Format) -> usize {
        8 * self.nt * self.per_split * f.token_bytes
    }

    /// The work of the busiest warp of a launch of `tiles` row tiles (`busiest_work`, an item's
    /// end counted as `end` tenths of a unit).
    fn busiest(&self, tiles: usize, end: usize) -> usize {
        busiest_work(
            items_a_warp(tiles, self.blocks, self.warps),
            self.per_split,
            end,
        )
    }
}

/// The launch shape for `n` tokens (at most 8 · `f.most_nt`) and `tiles` row tiles of `k`
/// values (a multiple of `f.unit`) on `sms` multiprocessors; None where the tiles are too many
/// to split. Blocks of more warps than `BLOCK_WARPS` (`Tuning::wide_warps`) where they are the
/// faster (`wide_pays`) in no more splits (a split's parts and their fix-up, which the estimate
/// leaves out, made E4B's o 8 splits of 1 unit slower than 4 of 2 under 8 warps: 11.8 against
/// 10.6 µs, docs/perf.md session 50), under `Tuning::wide_when_faster`; else where their
/// launch fills every multiprocessor.
fn shape(t: &Tuning, f: &Format, tiles: usize, k: usize, n: usize, sms: usize) -> Option<Shape> {
    let nt = n.div_ceil(8).next_power_of_two().min(f.most_nt);
    let narrow = shape_of_warps(t, f, tiles, k, nt, sms, BLOCK_WARPS);
    let warps = t.block_warps(nt);
    if warps == BLOCK_WARPS {
        return narrow;
    }
    let wide = shape_of_warps(t, f, tiles, k, nt, sms, warps)?;
    let takes_wide = if t.wide_when_faster {
        narrow
            .as_ref()
            .is_none_or(|narrow| wide.splits <= narrow.splits && wide_pays(t, tiles, &wide, narrow))
    } else {
        wide.blocks * wide.splits >= sms
    };
    if takes_wide {
        Some(wide)
    } else {
        narrow
    }
}

/// A multiprocessor's rate of units with a block of 12 warps, in eighths of its rate with one
/// of `BLOCK_WARPS`: E4B Q4_K gate + up at 64 tokens on the H100 ran 10 units on its busiest
/// warp in 44.7 µs against 15 in 50.6 (docs/perf.md session 49), 12 / 4.47 against 8 / 3.37
/// units a µs, 1.13 times (`wide_pays` takes it for blocks of 16 warps too, unmeasured).
const WIDE_RATE_EIGHTHS: usize = 9;

/// Whether a launch of `tiles` row tiles shaped `wide` (blocks of more than `BLOCK_WARPS`
/// warps) ends sooner than shaped `narrow`: its busiest warp's work (`busiest_work`) over a
/// warp's rate, which is `WIDE_RATE_EIGHTHS` / 8 of the multiprocessor's over its warps.
fn wide_pays(t: &Tuning, tiles: usize, wide: &Shape, narrow: &Shape) -> bool {
    let work = |sh: &Shape| sh.busiest(tiles, t.item_end) * sh.warps;
    work(wide) * 8 < work(narrow) * WIDE_RATE_EIGHTHS
}

/// `shape` with blocks of `warps` warps and `nt` n-tiles.
fn shape_of_warps(
    t: &Tuning,
    f: &Format,
    tiles: usize,
    k: usize,
    nt: usize,
    sms: usize,
    warps: usize,
) -> Option<Shape> {
    let units = k / f.unit;
    let most_per_split = (t.max_shared(nt) / (8 * nt * f.token_bytes)).min(units);
    let resident = |splits: usize| (t.blocks_per_sm(nt) * sms / splits).max(1);
    let blocks = |splits: usize| tiles.div_ceil(warps).min(resident(splits));
    let per_split = if nt > 4 && t.balance {
        let busiest = |p: usize| {
            let splits = units.div_ceil(p);
            let items = items_a_warp(tiles, blocks(splits), warps);
            (busiest_work(items, p, t.item_end), splits)
        };
        (1..=most_per_split)
            .filter(|&p| units.div_ceil(p) < t.wide_splits || p == most_per_split)
            .min_by_key(|&p| busiest(p))?
    } else {
        let items = if nt > 4 { t.wide_items } else { t.items };
        let want = (items * sms)
            .div_ceil(tiles)
            .clamp(units.div_ceil(most_per_split), units);
        units.div_ceil(want)
    };
    let splits = units.div_ceil(per_split);
    if splits > 1 && tiles > TICKETS {
        return None;
    }
    Some(Shape {
        nt,
        splits,
        per_split,
        blocks: blocks(splits),
        warps,
    })
}

/// Items on the busiest warp of a split of `blocks` blocks of `warps` warps walking `tiles`
/// row tiles grid-stride.
fn items_a_warp(tiles: usize, blocks: usize, warps: usize) -> usize {
    tiles.div_ceil(warps * blocks)
}

/// The work of a warp with `items` items of `per_split` units, in tenths of a unit: an item's
/// end (the staging's share, the part's stores and the last split's fix-up, with their round
/// trips) counted as `end` tenths — by default half a unit, the best of 0, 5 and 10 measured
/// (docs/perf.md session 46: 0 gave gate + up 10 splits of 1 unit and ran the 64-sequence
/// step 22 % slower).
fn busiest_work(items: usize, per_split: usize, end: usize) -> usize {
    items * (10 * per_split + end)
}

/// What one launch computes: products of matrices of one width, or a gated pair.
pub(crate) enum Job<'a> {
    /// `out_i = x · w_iᵀ` as f32 (up to `MAX_PRODUCTS` matrices).
    Products(&'a [(&'a CudaMatrix, u64)]),
    /// `out = gelu_tanh(x · gateᵀ) · (x · upᵀ)` rounded to the activations' 16-bit type.
    Gated {
        gate: &'a CudaMatrix,
        up: &'a CudaMatrix,
        out: u64,
    },
}

/// What a launch's plan depends on: its matrices' storage and width, their row tiles, and
/// whether it holds one matrix alone.
struct Extent {
    ty: GgmlType,
    cols: usize,
    tiles: usize,
    alone: bool,
}

impl Extent {
    /// Products of matrices stored as `ty`, `cols` wide, of `rows` rows each: tiles of 16
    /// rows.
    fn products(ty: GgmlType, cols: usize, rows: impl ExactSizeIterator<Item = usize>) -> Extent {
        let alone = rows.len() == 1;
        Extent {
            ty,
            cols,
            tiles: rows.map(|r| r.div_ceil(16)).sum(),
            alone,
        }
    }
}

impl Job<'_> {
    /// The first matrix: all share its format and width.
    fn first(&self) -> &CudaMatrix {
        match self {
            Job::Products(products) => products[0].0,
            Job::Gated { gate, .. } => gate,
        }
    }

    /// The launch's `Extent`: a gated pair counts as one matrix of tiles of 8 gate rows and
    /// the 8 up rows beside them.
    fn extent(&self) -> Extent {
        let w0 = self.first();
        match self {
            Job::Products(p) => Extent::products(w0.ty, w0.cols, p.iter().map(|(w, _)| w.rows)),
            Job::Gated { gate, .. } => Extent {
                ty: w0.ty,
                cols: w0.cols,
                tiles: gate.rows.div_ceil(8),
                alone: true,
            },
        }
    }
}

/// A launch of a plan: its first token row, its token rows, its shape and shared memory.
type Launch = (usize, usize, Shape, usize);

/// The launches of a job of extent `e` for `n` token rows on `sms` multiprocessors that give a
/// block `most_shared` bytes, if the kernels take it: a format they have, `mma_suits` rows and
/// width, tiles few enough to split, and shared memory enough (GPUs of compute capability 8.6
/// and 8.9 give 99 KB). Rows past a launch's most (64) are cut into runs of 64 and a last one,
/// each planned as its own product (`plan_rows`), so each reads the weights again: a step of
/// a few more rows than 64 — a serving step's decode rows and a new request's prompt — streams
/// them twice rather than dequantizing every matrix to f16 for cuBLAS, which ran E4B Q8_0's
/// 65- and 128-row decode steps at 11.0 and 12.1 ms against 5.7 ms at 64 (H100, docs/perf.md
/// session 53).
fn plan(t: &Tuning, e: &Extent, n: usize, sms: usize, most_shared: usize) -> Option<Vec<Launch>> {
    let f = format(e.ty)?;
    if !mma_suits(e.ty, e.cols, n) {
        return None;
    }
    let most = 8 * f.most_nt;
    let mut all = Vec::new();
    for t0 in (0..n).step_by(most) {
        let run = plan_rows(t, &f, e, (n - t0).min(most), sms, most_shared)?;
        all.extend(
            run.into_iter()
                .map(|(r0, len, sh, sm)| (t0 + r0, len, sh, sm)),
        );
    }
    Some(all)
}

/// `plan` for `n` token rows, 1 to 64: up to `LAUNCH_TOKENS` rows take one launch; 33–64 one
/// launch of 8 n-tiles where it splits its tiles fewer than `WIDE_SPLITS` ways, else launches
/// of `LAUNCH_TOKENS` rows, which one matrix alone takes up to `ALONE_TOKENS`.
fn plan_rows(
    t: &Tuning,
    f: &Format,
    e: &Extent,
    n: usize,
    sms: usize,
    most_shared: usize,
) -> Option<Vec<Launch>> {
    let launches = |chunk: usize| -> Option<Vec<Launch>> {
        (0..n)
            .step_by(chunk)
            .map(|t0| {
                let len = (n - t0).min(chunk);
                let sh = shape(t, f, e.tiles, e.cols, len, sms)?;
                let shared = sh.shared(f);
                (shared <= most_shared).then_some((t0, len, sh, shared))
            })
            .collect()
    };
    if n > LAUNCH_TOKENS {
        if let Some(one) = launches(n).filter(|p| p[0].2.splits < t.wide_splits) {
            return Some(one);
        }
        if e.alone && n > ALONE_TOKENS {
            return None;
        }
    }
    launches(LAUNCH_TOKENS)
}

impl CudaBackend {
    /// The launches of a job of extent `e` for `n` token rows (`plan`) on a device of compute
    /// capability 8.0 or newer.
    fn mmq_plan(&self, e: &Extent, n: usize) -> Option<Vec<Launch>> {
        if self.dev.capability().0 < 8 {
            return None;
        }
        let sms = self.dev.multiprocessors() as usize;
        plan(
            &self.mmq_tuning,
            e,
            n,
            sms,
            self.dev.max_block_shared() as usize,
        )
    }

    /// Whether `mmq` takes `job` for `n` token rows.
    pub(crate) fn mmq_takes(&self, job: &Job<'_>, n: usize) -> bool {
        self.mmq_plan(&job.extent(), n).is_some()
    }

    /// Whether a product of `n` token rows of matrices of `rows` rows each (one call of
    /// `matmul_many`, or `matmul` for one), stored as `ty`, `cols` wide, runs on the
    /// tensor-core kernels here (their rounding differs from cuBLAS's on dequantized weights:
    /// the GPU tests model it).
    pub fn mmq_takes_products(&self, ty: GgmlType, cols: usize, rows: &[usize], n: usize) -> bool {
        let e = Extent::products(ty, cols, rows.iter().copied());
        !rows.is_empty() && !self.f16_copy_applies(ty, n) && self.mmq_plan(&e, n).is_some()
    }

    /// Runs `job` for `n` token rows whose activations `xh` are rounded to the 16-bit type of
    /// the weights' products (f16), sizes checked by the caller, in the launches of
    /// `mmq_plan`; false (nothing queued) where the kernels do not take it
    /// (`mmq_plan`). The parts of split tiles go to the f16 tile scratch, which the caller
    /// does not hold `xh` in.
    pub(crate) fn mmq(&self, s: &mut Scratch, xh: u64, n: usize, job: Job<'_>) -> Result<bool> {
        let e = job.extent();
        let Some(launches) = self.mmq_plan(&e, n) else {
            return Ok(false);
        };
        let (w0, tiles, k) = (job.first(), e.tiles, e.cols);
        for (t0, len, sh, shared) in launches {
            let mut args = ProductArgs::default();
            let gated = match job {
                Job::Products(products) => {
                    args.count = products.len() as i32;
                    for (i, &(w, out)) in products.iter().enumerate() {
                        args.w[i] = w.ptr;
                        args.out[i] = out + 4 * (t0 * w.rows) as u64;
                        args.rows[i] = int("rows", w.rows)?;
                    }
                    false
                }
                Job::Gated { gate, up, out } => {
                    args.count = 2;
                    args.w[..2].copy_from_slice(&[gate.ptr, up.ptr]);
                    args.out[0] = out + 2 * (t0 * gate.rows) as u64;
                    args.rows[..2].copy_from_slice(&[int("rows", gate.rows)?; 2]);
                    true
                }
            };
            let parts = if sh.splits > 1 {
                // 16 floats a tile, token slot (8 · nt, at least `len`) and split, in f16
                // slots (the parts keep every slot's, mmq.cu `mmq_gather`).
                s.tiles
                    .get(&self.dev.stream, 32 * sh.splits * 8 * sh.nt * tiles)?
            } else {
                0
            };
            let kernel = self.kernels.func_for_with_shared(
                Module::Gemv,
                "mmq",
                w0.ty,
                sh.nt as u32,
                shared as u32,
            )?;
            let mut grid = Grid::new((sh.blocks as u32, sh.splits as u32), 32 * sh.warps as u32);
            grid.shared = shared as u32;
            self.launch_fn(
                &kernel,
                grid,
                &[
                    Arg::Products(args),
                    Arg::U64(w0.row_bytes as u64),
                    Arg::I32(int("cols", k)?),
                    Arg::U64(xh + 2 * (t0 * k) as u64),
                    Arg::I32(len as i32),
                    Arg::I32(gated.into()),
                    Arg::U64(parts),
                    Arg::U64(self.mmq_tickets()),
                    Arg::I32(sh.splits as i32),
                    Arg::I32(sh.per_split as i32),
                ],
            )?;
        }
        Ok(true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sources::define_lines;

    /// The tuning of the `MARKBASE_CUDA_DEFINES` value `spec`.
    fn tuning(spec: &str) -> Tuning {
        Tuning::from_defines(&define_lines(spec).unwrap()).unwrap()
    }

    /// Session 39's rules: a block of 8 warps a multiprocessor, the items rule, declined from 8
    /// splits.
    const ITEMS_RULE: &str =
        "MMQ_WIDE_BLOCKS=1 MMQ_WIDE_WARPS=8 MMQ_WIDE_BALANCE=0 MMQ_WIDE_SPLITS=8";

    /// The measured tuning and those of a sweep (`Tuning::from_defines`).
    fn tunings() -> impl Iterator<Item = Tuning> {
        [
            "",
            ITEMS_RULE,
            "MMQ_WIDE_BALANCE=0 MMQ_WIDE_ITEMS=16 MMQ_WIDE_SPLITS=12",
            "MMQ_WIDE_BLOCKS=2",
            "MMQ_WIDE_BALANCE=0 MMQ_WIDE_SPLITS=8",
            "MMQ_WIDE_WARPS=16",
            "MMQ_WIDE_WARPS=8",
            "MMQ_WIDE_PAYS=0",
        ]
        .into_iter()
        .map(tuning)
    }

    #[test]
    fn tunings_come_from_the_defines_and_bad_values_are_named() {
        let t: Vec<Tuning> = tunings().collect();
        assert_eq!(t[0], Tuning::DEFAULT);
        assert_eq!(
            (t[0].wide_blocks, t[0].max_shared(8), t[0].blocks_per_sm(8)),
            (1, WIDE_SHARED, 1)
        );
        assert_eq!(
            (t[3].wide_blocks, t[3].max_shared(8), t[3].blocks_per_sm(8)),
            (2, WIDE_SHARED_TWO, 2)
        );
        assert_eq!(
            (t[2].wide_items, t[2].wide_splits, t[2].balance),
            (16, 12, false)
        );
        assert!(t[1].wide_blocks == 1 && !t[1].balance && t[1].wide_splits == 8);
        assert!(t[3].balance && t[3].wide_splits == 24);
        assert_eq!(
            (
                t[0].block_warps(8),
                t[5].block_warps(8),
                t[5].block_warps(4)
            ),
            (12, 16, BLOCK_WARPS)
        );
        let more = tuning("MMQ_ITEMS=16");
        assert_eq!(
            more,
            Tuning {
                items: 16,
                ..Tuning::DEFAULT
            }
        );
        // E4B's o at 32 tokens (160 tiles of 8 units): 8 items a multiprocessor split 4 ways,
        // 16 8 ways (a unit each); q/k/v (192 of 10): 5 ways, 10 ways.
        let q4k = format(GgmlType::Q4_K).unwrap();
        let splits = |t: &Tuning, tiles, k| shape(t, &q4k, tiles, k, 32, 132).unwrap().splits;
        assert_eq!((splits(&t[0], 160, 2048), splits(&more, 160, 2048)), (4, 8));
        assert_eq!(
            (splits(&t[0], 192, 2560), splits(&more, 192, 2560)),
            (5, 10)
        );
        // Launches of 4 n-tiles or fewer keep their rules.
        assert_eq!(
            (t[0].max_shared(4), t[0].blocks_per_sm(4)),
            (MAX_SHARED, BLOCKS_PER_SM)
        );
        for bad in [
            "MMQ_WIDE_BLOCKS=3",
            "MMQ_WIDE_SPLITS=1",
            "MMQ_WIDE_BALANCE=2",
            "MMQ_WIDE_ITEMS=x",
            "MMQ_WIDE_ITEM_END=41",
            "MMQ_WIDE_WARPS=10",
            "MMQ_WIDE_WARPS=20",
            "MMQ_WIDE_WARPS=12 MMQ_WIDE_BLOCKS=2",
            "MMQ_WIDE_PAYS=2",
        ] {
            let e = Tuning::from_defines(&define_lines(bad).unwrap())
                .unwrap_err()
                .to_string();
            assert!(e.contains(bad) && e.contains(DEFINES_VAR), "{bad}: {e}");
        }
    }

    #[test]
    fn e4b_launches_at_64_tokens_under_each_setting() {
        // (splits, units a split, blocks a split, units on the busiest warp, warps a block) of
        // E4B's q/k/v, o, gate + up, down, PLE gate and PLE projection at 64 tokens on an
        // H200, or None (launches of 32 rows, or cuBLAS): the table of docs/perf.md session
        // 43 (its one block a multiprocessor is now the default), the defaults of sessions
        // 44–45 and 46, of sessions 47–48, blocks of 16 warps and the default from session
        // 49, 12 (only gate + up fills every multiprocessor with them: 3 splits of 4 units, 8
        // units on the busiest warp, and 2 splits of 5, 10 units, where 8 warps have 15; the
        // rest keep 8 warps), and the default from session 50: blocks of 12 warps where
        // `wide_pays` estimates them the faster in no more splits — down too (8 splits of 5
        // units, 5 on the busiest warp against 8; 14 blocks a split, 112 of 132
        // multiprocessors), not o (8 splits of 1 unit against 4 of 2).
        type Cell = Option<(usize, usize, usize, usize, usize)>;
        let cell = |t: &Tuning, cols: usize, rows: &[usize], gated: bool| -> Cell {
            let mut e = Extent::products(GgmlType::Q4_K, cols, rows.iter().copied());
            if gated {
                e.tiles = rows[0].div_ceil(8);
            }
            let p = plan(t, &e, 64, 132, 227 << 10)?;
            assert_eq!(p.len(), 1);
            let sh = &p[0].2;
            let busiest = sh.busiest(e.tiles, 0) / 10;
            Some((sh.splits, sh.per_split, sh.blocks, busiest, sh.warps))
        };
        let specs = [
            ITEMS_RULE,
            "MMQ_WIDE_BLOCKS=2 MMQ_WIDE_BALANCE=0 MMQ_WIDE_SPLITS=8",
            "MMQ_WIDE_BLOCKS=2 MMQ_WIDE_BALANCE=0 MMQ_WIDE_ITEMS=16 MMQ_WIDE_SPLITS=16",
            "MMQ_WIDE_BLOCKS=2 MMQ_WIDE_ITEM_END=10",
            "MMQ_WIDE_BLOCKS=2",
            "MMQ_WIDE_WARPS=8",
            "MMQ_WIDE_WARPS=16 MMQ_WIDE_PAYS=0",
            "MMQ_WIDE_PAYS=0",
            "",
        ];
        let want: [[Cell; 6]; 9] = [
            [
                Some((5, 2, 24, 2, 8)),
                Some((4, 2, 20, 2, 8)),
                Some((2, 5, 66, 15, 8)),
                None,
                None,
                Some((1, 1, 20, 1, 8)),
            ],
            [
                Some((5, 2, 24, 2, 8)),
                Some((4, 2, 20, 2, 8)),
                Some((4, 3, 66, 9, 8)),
                None,
                None,
                Some((1, 1, 20, 1, 8)),
            ],
            [
                Some((10, 1, 24, 1, 8)),
                Some((8, 1, 20, 1, 8)),
                Some((4, 3, 66, 9, 8)),
                Some((14, 3, 18, 6, 8)),
                Some((10, 1, 2, 1, 8)),
                Some((1, 1, 20, 1, 8)),
            ],
            [
                Some((10, 1, 24, 1, 8)),
                Some((8, 1, 20, 1, 8)),
                Some((4, 3, 66, 9, 8)),
                Some((20, 2, 13, 4, 8)),
                Some((10, 1, 2, 1, 8)),
                Some((1, 1, 20, 1, 8)),
            ],
            [
                Some((10, 1, 24, 1, 8)),
                Some((8, 1, 20, 1, 8)),
                Some((5, 2, 52, 8, 8)),
                Some((20, 2, 13, 4, 8)),
                Some((10, 1, 2, 1, 8)),
                Some((1, 1, 20, 1, 8)),
            ],
            [
                Some((5, 2, 24, 2, 8)),
                Some((4, 2, 20, 2, 8)),
                Some((2, 5, 66, 15, 8)),
                Some((10, 4, 13, 8, 8)),
                Some((10, 1, 2, 1, 8)),
                Some((1, 1, 20, 1, 8)),
            ],
            [
                Some((5, 2, 24, 2, 8)),
                Some((4, 2, 20, 2, 8)),
                Some((3, 4, 44, 8, 16)),
                Some((10, 4, 13, 8, 8)),
                Some((10, 1, 2, 1, 8)),
                Some((1, 1, 20, 1, 8)),
            ],
            [
                Some((5, 2, 24, 2, 8)),
                Some((4, 2, 20, 2, 8)),
                Some((2, 5, 66, 10, 12)),
                Some((10, 4, 13, 8, 8)),
                Some((10, 1, 2, 1, 8)),
                Some((1, 1, 20, 1, 8)),
            ],
            [
                Some((5, 2, 24, 2, 8)),
                Some((4, 2, 20, 2, 8)),
                Some((2, 5, 66, 10, 12)),
                Some((8, 5, 14, 5, 12)),
                Some((10, 1, 2, 1, 8)),
                Some((1, 1, 20, 1, 8)),
            ],
        ];
        for (spec, want) in specs.iter().zip(want) {
            let t = tuning(spec);
            let got = [
                cell(&t, 2560, &[2048, 512, 512], false),
                cell(&t, 2048, &[2560], false),
                cell(&t, 2560, &[10_240], true),
                cell(&t, 10_240, &[2560], false),
                cell(&t, 2560, &[256], false),
                cell(&t, 256, &[2560], false),
            ];
            assert_eq!(got, want, "{spec}");
        }
    }

    #[test]
    fn a_balanced_launch_weighs_units_against_item_ends() {
        // E4B's down at 64 tokens (160 tiles of 40 units) on an H200, balanced, splitting
        // under 24 ways: a block a multiprocessor, 10 splits of 4 units (13 blocks a split, 2
        // items on the busiest warp: 2 · 5) beats 8 of 5 (2 · 6) and 20 of 2 (4 · 3); two, 20
        // of 2 (2 · 3) beats 14 of 3 (2 · 4). Gate + up (1 280 tiles of 10 units): 2 of 5
        // (3 · 6) beats 10 of 1 (13 · 2), though its busiest warp has more units (15 to 13).
        // (These counts, as `work`'s, take an item's end as a whole unit; at the default's
        // half unit the same shapes win: 2 · 4.5 against 2 · 5.5 and 4 · 2.5; 2 · 2.5 against
        // 2 · 3.5; 3 · 5.5 against 13 · 1.5.)
        let q4k = format(GgmlType::Q4_K).unwrap();
        let work = |tiles: usize, sh: &Shape| sh.busiest(tiles, 10) / 10;
        let (one, two) = (tuning("MMQ_WIDE_WARPS=8"), tuning("MMQ_WIDE_BLOCKS=2"));
        let down = shape(&one, &q4k, 160, 10_240, 64, 132).unwrap();
        assert_eq!((down.splits, down.per_split, work(160, &down)), (10, 4, 10));
        let down = shape(&two, &q4k, 160, 10_240, 64, 132).unwrap();
        assert_eq!((down.splits, down.per_split, work(160, &down)), (20, 2, 6));
        let gate_up = shape(&one, &q4k, 1280, 2560, 64, 132).unwrap();
        assert_eq!((gate_up.splits, work(1280, &gate_up)), (2, 18));
        // Here the balance and the items rule agree.
        let items_rule = tuning(ITEMS_RULE);
        assert_eq!(shape(&items_rule, &q4k, 1280, 2560, 64, 132), Some(gate_up));
        // Two blocks a multiprocessor, an item's end counted as half a unit (session 46):
        // gate + up in 5 splits of 2 units (4 items on the busiest warp: 4 · 2.5) beats 4 of
        // 3 (3 · 3.5); counted as a whole unit (sessions 44–45), 4 of 3 (3 · 4) ties 5 of 2
        // (4 · 3) and takes fewer splits; with items' ends free, 10 of 1 (7 · 1) beats 5 of 2
        // (4 · 2) and 4 of 3 (3 · 3).
        let gate_up = shape(&two, &q4k, 1280, 2560, 64, 132).unwrap();
        assert_eq!(
            (gate_up.splits, gate_up.per_split, gate_up.blocks),
            (5, 2, 52)
        );
        let whole_ends = tuning("MMQ_WIDE_BLOCKS=2 MMQ_WIDE_ITEM_END=10");
        let gate_up = shape(&whole_ends, &q4k, 1280, 2560, 64, 132).unwrap();
        assert_eq!((gate_up.splits, work(1280, &gate_up)), (4, 12));
        let free_ends = tuning("MMQ_WIDE_BLOCKS=2 MMQ_WIDE_ITEM_END=0");
        let gate_up = shape(&free_ends, &q4k, 1280, 2560, 64, 132).unwrap();
        assert_eq!(
            (gate_up.splits, gate_up.per_split, gate_up.blocks),
            (10, 1, 26)
        );
    }

    #[test]
    fn shapes_cover_every_unit_once_and_fit_shared_memory() {
        // E4B's launches on an H200 (132 multiprocessors), as (row tiles, width): q/k/v, o,
        // gate + up (two matrices, or the gated pair: 1 280 tiles either way), down, the PLE
        // gate and projection, the LM head; a short odd matrix.
        let q4k = format(GgmlType::Q4_K).unwrap();
        for (tiles, k) in [
            (192, 2560),
            (160, 2048),
            (1280, 2560),
            (160, 10_240),
            (16, 2560),
            (160, 256),
            (16_384, 2560),
            (5, 12_800),
        ] {
            // One launch's token rows, under each tuning of a sweep.
            for (t, n) in
                tunings().flat_map(|t| [2, 8, 9, 16, 17, 25, 32, 33, 48, 64].map(|n| (t, n)))
            {
                let sh = shape(&t, &q4k, tiles, k, n, 132).unwrap();
                let units = k / q4k.unit;
                assert!(sh.nt * 8 >= n && (sh.nt == 1 || sh.nt * 4 < n), "{n}");
                assert!(sh.nt <= q4k.most_nt && sh.nt.is_power_of_two());
                assert!(sh.splits * sh.per_split >= units);
                assert!((sh.splits - 1) * sh.per_split < units, "no empty split");
                assert!(
                    sh.shared(&q4k) <= t.max_shared(sh.nt),
                    "{tiles}x{k} n={n}: {sh:?}"
                );
                let resident = t.blocks_per_sm(sh.nt) * 132;
                assert!(sh.blocks * sh.splits <= resident || sh.blocks == 1);
                assert!(sh.blocks >= 1 && sh.blocks <= tiles.div_ceil(sh.warps));
                // Enough items, or one super-block a split, or shared memory full.
                assert!(
                    2 * tiles * sh.splits >= 8 * 132
                        || sh.per_split == 1
                        || sh.per_split * 2 > t.max_shared(sh.nt) / (64 * sh.nt * q4k.token_bytes)
                        || (t.balance && sh.nt > 4),
                    "{tiles}x{k} n={n}: {sh:?}"
                );
            }
        }
        let d = Tuning::DEFAULT;
        assert_eq!(
            shape(&d, &q4k, 160, 10_240, 8, 132),
            Some(Shape {
                nt: 1,
                splits: 7,
                per_split: 6,
                blocks: 20,
                warps: 8,
            })
        );
        assert_eq!(shape(&d, &q4k, TICKETS + 1, 12_800, 32, 132), None);
    }

    #[test]
    fn launches_of_33_to_64_rows_take_8_n_tiles_unless_they_split_8_ways() {
        // Under session 39's rules (declined from 8 splits; the default declines from 24).
        let items_rule = tuning(ITEMS_RULE);
        let h200 = |ty, cols, rows: &[usize], n| {
            let e = Extent::products(ty, cols, rows.iter().copied());
            plan(&items_rule, &e, n, 132, 227 << 10).map(|p| {
                p.iter()
                    .map(|(t0, len, sh, _)| (*t0, *len, sh.nt, sh.splits))
                    .collect::<Vec<_>>()
            })
        };
        let q4k = GgmlType::Q4_K;
        // E4B's q, k and v; gate alone; o: one launch.
        assert_eq!(
            h200(q4k, 2560, &[2048, 512, 512], 64),
            Some(vec![(0, 64, 8, 5)])
        );
        assert_eq!(h200(q4k, 2560, &[10_240], 40), Some(vec![(0, 40, 8, 2)]));
        assert_eq!(h200(q4k, 2048, &[2560], 64), Some(vec![(0, 64, 8, 4)]));
        // Down splits 8 ways at 8 n-tiles: launches of 32 rows up to 48, cuBLAS past.
        assert_eq!(
            h200(q4k, 10_240, &[2560], 48),
            Some(vec![(0, 32, 4, 8), (32, 16, 2, 7)])
        );
        assert_eq!(h200(q4k, 10_240, &[2560], 49), None);
        // Several matrices that split 8 ways: launches of 32 rows up to 64.
        assert_eq!(
            h200(q4k, 10_240, &[2560, 2560], 64),
            Some(vec![(0, 32, 4, 8), (32, 32, 4, 8)])
        );
        // Up to 32 rows: one launch of up to 4 n-tiles.
        assert_eq!(h200(q4k, 10_240, &[2560], 32), Some(vec![(0, 32, 4, 8)]));
        assert_eq!(h200(GgmlType::BF16, 2560, &[2048], 8), None);
        // 65–128 rows: a run of 64 planned as above, then the rest (one row on one n-tile).
        assert_eq!(
            h200(q4k, 2560, &[2048, 512, 512], 65),
            Some(vec![(0, 64, 8, 5), (64, 1, 1, 5)])
        );
        assert_eq!(
            h200(q4k, 10_240, &[2560, 2560], 100),
            Some(vec![
                (0, 32, 4, 8),
                (32, 32, 4, 8),
                (64, 32, 4, 8),
                (96, 4, 1, 4)
            ])
        );
        assert_eq!(
            h200(q4k, 2560, &[10_240], 128),
            Some(vec![(0, 64, 8, 2), (64, 64, 8, 2)])
        );
        // A run that one matrix alone would give cuBLAS gives it the whole product.
        assert_eq!(h200(q4k, 10_240, &[2560], 112), None);
        assert_eq!(h200(q4k, 2560, &[2048, 512, 512], 129), None);
    }

    #[test]
    fn launches_cover_every_token_row_once() {
        for tuning in tunings() {
            for (ty, cols, rows) in [
                (GgmlType::Q4_K, 2560, vec![2048, 512, 512]),
                (GgmlType::Q8_0, 10_240, vec![2560]),
                (GgmlType::Q6_K, 2560, vec![262_144]),
            ] {
                let e = Extent::products(ty, cols, rows.iter().copied());
                for n in 2..=128 {
                    let Some(p) = plan(&tuning, &e, n, 132, 227 << 10) else {
                        continue;
                    };
                    let mut next = 0;
                    for (t0, len, sh, _) in p {
                        assert_eq!(t0, next, "{ty} {rows:?} n={n}");
                        assert!(len >= 1 && len <= 8 * sh.nt && sh.nt <= 8, "{ty} n={n}");
                        next += len;
                    }
                    assert_eq!(next, n, "{ty} {rows:?} n={n}");
                }
            }
        }
    }

    #[test]
    fn few_token_products_take_the_tensor_cores() {
        let (q4k, q8) = (GgmlType::Q4_K, GgmlType::Q8_0);
        assert!(!mma_suits(q4k, 256, 1));
        assert!(mma_suits(q4k, 256, 2));
        assert!(mma_suits(q4k, 2560, 33) && mma_suits(q4k, 2560, 64));
        assert!(mma_suits(q4k, 2560, 65) && mma_suits(q4k, 2560, 128));
        assert!(!mma_suits(q4k, 2560, 129));
        assert!(mma_suits(q8, 2560, 2) && mma_suits(q8, 512, 48));
        assert!(!mma_suits(q8, 2560, 1) && !mma_suits(q8, 2560, 129));
        // Q8_0 rows of a part group (layout.rs) stay on the other paths.
        assert!(!mma_suits(q8, 640, 8) && !mma_suits(q8, 96, 8));
        for ty in [GgmlType::Q5_K, GgmlType::Q6_K] {
            assert!(mma_suits(ty, 2560, 8) && !mma_suits(ty, 2560, 1));
        }
        // Q4_0 / Q5_0 rows of whole 8-block units (layout.rs); 640 wide stays as stored.
        for ty in [GgmlType::Q4_0, GgmlType::Q5_0] {
            assert!(mma_suits(ty, 2560, 8) && !mma_suits(ty, 640, 8) && !mma_suits(ty, 2560, 1));
        }
        assert!(!mma_suits(GgmlType::Q5_1, 2560, 8) && !mma_suits(GgmlType::BF16, 2560, 8));
    }
}
