//! Argmax and sampling on the device against their host twins.

use super::*;
use markbase_core::sampling::{distribution, pick};

#[test]
fn argmax_and_sampling_match_host_twins() {
    let g = gpu_or_skip!();
    let mut r = rng("sampling");
    let (rows, n) = (3, 262_144);
    let mut logits = uniform(&mut r, rows * n, 10.0);
    // A tie: the lower index must win.
    logits[n + 500] = 99.0;
    logits[n + 70_000] = 99.0;
    logits[2 * n + 9] = f32::NAN;
    let lb = up(g, &logits);
    let got = g.argmax(&lb, rows, n).unwrap();
    let want: Vec<u32> = logits
        .chunks(n)
        .map(|row| {
            let mut best = 0;
            for (i, &v) in row.iter().enumerate() {
                if v > row[best] || row[best].is_nan() {
                    best = i;
                }
            }
            best as u32
        })
        .collect();
    assert_eq!(got, want, "argmax");
    assert_eq!(got[1], 500);
    // Rows whose last slice of the first pass is partial, and rows shorter than one slice.
    for (rows, n) in [(5, 4097), (2, 7)] {
        let small = uniform(&mut r, rows * n, 10.0);
        let got = g.argmax(&up(g, &small), rows, n).unwrap();
        let want: Vec<u32> = small
            .chunks(n)
            .map(|row| (0..n).fold(0, |b, i| if row[i] > row[b] { i } else { b }) as u32)
            .collect();
        assert_eq!(got, want, "argmax of {rows} rows of {n}");
    }
    // Every kind of draw on rows of a 262 144-token vocabulary, NaN and ties included:
    // greedy, every token (with min-p, and a top-k past the row), and in rank order top-k,
    // top-p (a nucleus over the whole row) and min-p alone and together.
    let lb = up(g, &logits);
    let draw = |temperature, top_k, top_p, min_p, u| Draw {
        temperature,
        top_k,
        top_p,
        min_p,
        u,
    };
    let kinds = [
        [
            draw(0.0, 0, 1.0, 0.0, 0.5),
            draw(1.0, 0, 1.0, 0.0, 0.5),
            draw(0.7, 0, 1.0, 0.05, 0.5),
        ],
        [
            draw(1.3, usize::MAX, 1.0, 0.0, 0.5),
            draw(0.8, 40, 0.9, 0.05, 0.5),
            draw(2.0, 256, 0.5, 0.0, 0.5),
        ],
        [
            draw(1.0, 0, 0.9, 0.0, 0.5),
            draw(1.0, 5000, 1.0, 0.0, 0.5),
            draw(0.9, 3, 1.0, 0.0, 0.5),
        ],
        [
            draw(1.0, 0, 0.99, 0.2, 0.5),
            draw(0.6, 0, 0.5, 0.0, 0.5),
            draw(1.0, 100_000, 0.95, 0.0, 0.5),
        ],
    ];
    for round in 0..8 {
        let mut set = kinds[round % kinds.len()];
        for d in &mut set {
            d.u = r.random_range(0.0f32..1.0);
        }
        let got = g.sample(&lb, rows, n, &set).unwrap();
        for (t, d) in set.iter().enumerate() {
            let row = &logits[t * n..][..n];
            let place = |id: u32| {
                let mut cand = Vec::new();
                let kept = distribution(d, &mut cand, row);
                (kept.iter().position(|c| c.0 == id), kept.len())
            };
            let host = pick(d, &mut Vec::new(), row);
            assert!(
                agrees_with_pick(row, d, got[t]),
                "row {t} {d:?}: {} at {:?} of the host's kept tokens, the host's pick {host} at {:?}",
                got[t],
                place(got[t]),
                place(host)
            );
        }
    }
    let bad = Draw {
        temperature: -1.0,
        ..Draw::GREEDY
    };
    assert!(g.sample(&lb, rows, n, &[bad; 3]).is_err());
    assert!(g.sample(&lb, rows, n, &[Draw::GREEDY; 2]).is_err());
}
