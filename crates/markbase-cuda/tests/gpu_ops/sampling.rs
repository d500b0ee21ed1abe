//! Argmax and sampling on the device against their host twins.

use super::*;

/// Host twin of the top-k / top-p sampler.
fn sample_ref(row: &[f32], p: &SampleParams, u: f32) -> u32 {
    let mut idx: Vec<usize> = (0..row.len()).collect();
    idx.sort_by(|&a, &b| row[b].total_cmp(&row[a]).then(a.cmp(&b)));
    let cand = &idx[..p.top_k.min(row.len())];
    let mx = row[cand[0]];
    let e: Vec<f32> = cand
        .iter()
        .map(|&i| ((row[i] - mx) / p.temperature).exp())
        .collect();
    let total: f32 = e.iter().sum();
    let mut keep = cand.len();
    let mut mass = 0f32;
    for (c, v) in e.iter().enumerate() {
        mass += v / total;
        if mass >= p.top_p {
            keep = c + 1;
            break;
        }
    }
    let kept: f32 = e[..keep].iter().sum();
    let target = u * kept;
    let mut run = 0f32;
    for c in 0..keep {
        run += e[c];
        if target < run {
            return cand[c] as u32;
        }
    }
    cand[keep - 1] as u32
}

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
    let clean: Vec<f32> = logits
        .iter()
        .map(|v| if v.is_nan() { -1e30 } else { *v })
        .collect();
    let lb = up(g, &clean);
    for (top_k, top_p, temperature) in [(40, 0.9, 0.8), (1, 1.0, 1.0), (256, 0.5, 2.0)] {
        let p = SampleParams {
            temperature,
            top_k,
            top_p,
        };
        for _ in 0..5 {
            let draws: Vec<f32> = (0..rows).map(|_| r.random_range(0.0f32..1.0)).collect();
            let got = g.sample(&lb, rows, n, &p, &draws).unwrap();
            let want: Vec<u32> = clean
                .chunks(n)
                .zip(&draws)
                .map(|(row, &u)| sample_ref(row, &p, u))
                .collect();
            assert_eq!(got, want, "sample {p:?} draws {draws:?}");
        }
    }
    let bad = SampleParams {
        temperature: 0.0,
        top_k: 5,
        top_p: 1.0,
    };
    assert!(g.sample(&lb, rows, n, &bad, &[0.5; 3]).is_err());
}
