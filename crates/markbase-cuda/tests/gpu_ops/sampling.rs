//! Argmax and sampling on the device against their host twins.

use super::*;

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
    // Every kind of draw on rows of a 262 144-token vocabulary, NaN included: greedy, every
    // token (with min-p, and a top-k past the row), top-k with top-p and min-p, and
    // those the host finishes (a nucleus over the whole row, a top-k over MAX_TOP_K).
    let lb = up(g, &logits);
    for round in 0..4 {
        let draws = [
            Draw {
                u: r.random_range(0.0f32..1.0),
                ..Draw::GREEDY
            },
            Draw {
                temperature: 1.0,
                top_k: 0,
                top_p: 1.0,
                min_p: 0.0,
                u: r.random_range(0.0f32..1.0),
            },
            Draw {
                temperature: 0.7,
                top_k: 0,
                top_p: 1.0,
                min_p: 0.05,
                u: r.random_range(0.0f32..1.0),
            },
        ];
        let more = [
            Draw {
                temperature: 1.3,
                top_k: usize::MAX,
                top_p: 1.0,
                min_p: 0.0,
                u: r.random_range(0.0f32..1.0),
            },
            Draw {
                temperature: 0.8,
                top_k: 40,
                top_p: 0.9,
                min_p: 0.05,
                u: r.random_range(0.0f32..1.0),
            },
            Draw {
                temperature: 2.0,
                top_k: MAX_TOP_K,
                top_p: 0.5,
                min_p: 0.0,
                u: r.random_range(0.0f32..1.0),
            },
        ];
        let host = [
            Draw {
                temperature: 1.0,
                top_k: 0,
                top_p: 0.9,
                min_p: 0.0,
                u: r.random_range(0.0f32..1.0),
            },
            Draw {
                temperature: 1.0,
                top_k: MAX_TOP_K + 1,
                top_p: 1.0,
                min_p: 0.0,
                u: r.random_range(0.0f32..1.0),
            },
            Draw {
                temperature: 0.9,
                top_k: 3,
                top_p: 1.0,
                min_p: 0.0,
                u: r.random_range(0.0f32..1.0),
            },
        ];
        let set = [&draws, &more, &host][round % 3];
        let got = g.sample(&lb, rows, n, set).unwrap();
        for (t, d) in set.iter().enumerate() {
            let row = &logits[t * n..][..n];
            assert!(
                agrees_with_pick(row, d, got[t]),
                "row {t} {d:?}: {}",
                got[t]
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
