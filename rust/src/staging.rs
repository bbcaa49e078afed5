//! Packing a plan into the fixed shapes of a captured step graph: which mixed plans a
//! mixed-step graph can replay, where a mixed plan's sample rows land, and each sample
//! slot's sampling parameter. Pure functions over the plan's arrays, so that the core's
//! StepPlan and a tensor-parallel worker's copy of it (numpy arrays off the wire) stage the
//! same way through one implementation; `python.rs` wraps them for the graph runner, whose
//! staging runs on the critical path between two steps.
//!
//! A graph of bucket `bs` with B rows a block lays its sample slots out as: the `bs`
//! decoding slots' blocks (slot i: rows i*B..i*B+B), then one slot per prefill request of a
//! mixed step (`bs*B + j`). A plan's decoding requests lead it (entries 0..rd) and fill the
//! first rd decoding slots; slots rd..bs are padding.

/// One plan array to stage: the core's int64 or int32 values.
pub enum Src<'a> {
    I64(&'a [i64]),
    I32(&'a [i32]),
}

impl Src<'_> {
    pub fn len(&self) -> usize {
        match self {
            Src::I64(a) => a.len(),
            Src::I32(a) => a.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A plan's arrays into the graph runner's int64 staging buffer `d`: for each `(name, src,
/// at, total, pad)`, `src` goes to `d[at..at + len]` and `pad` fills `d[at + len..at +
/// total]` (`pad` None: the array's last value). With `pages = (tables, rows, cols, at, width,
/// rows_before, cols_before)` the row-major page tables go to rows of `width` from `d[at]`,
/// and what the previous staging covered (`rows_before` x `cols_before`) and this one does not
/// is zeroed (the null page). Checks every field before writing any.
#[allow(clippy::type_complexity)]
pub fn stage_arrays(
    d: &mut [i64],
    fields: &[(&str, Src<'_>, usize, usize, Option<i64>)],
    pages: Option<(&[i32], usize, usize, usize, usize, usize, usize)>,
) -> Result<(), String> {
    for (name, src, at, total, pad) in fields {
        let len = src.len();
        if len > *total || at + total > d.len() || (len == 0 && pad.is_none() && *total > 0) {
            return Err(format!(
                "stage_into: {name} ({len} values) does not fit {total} at {at} of {} (or has no last value to pad with)",
                d.len()
            ));
        }
    }
    if let Some((t, r, w, at, width, rows_before, cols_before)) = pages {
        if t.len() != r * w || w > width || cols_before > width || at + r.max(rows_before) * width > d.len() {
            return Err(format!(
                "stage_into: page tables of {r} x {w} (before: {rows_before} x {cols_before}) do not fit width {width} at {at} of {}",
                d.len()
            ));
        }
    }
    for (_, src, at, total, pad) in fields {
        let out = &mut d[*at..at + total];
        let len = src.len();
        match src {
            Src::I64(a) => out[..len].copy_from_slice(a),
            Src::I32(a) => out[..len].iter_mut().zip(a.iter()).for_each(|(o, &v)| *o = v as i64),
        }
        let fill = match pad {
            Some(v) => *v,
            None if len > 0 => out[len - 1],
            None => 0,
        };
        out[len..].fill(fill);
    }
    if let Some((t, r, w, at, width, rows_before, cols_before)) = pages {
        for i in 0..r.max(rows_before) {
            let row = &mut d[at + i * width..at + (i + 1) * width];
            if i < r {
                row[..w].iter_mut().zip(&t[i * w..(i + 1) * w]).for_each(|(o, &v)| *o = v as i64);
                if i < rows_before && cols_before > w {
                    row[w..cols_before].fill(0);
                }
            } else {
                row[..cols_before].fill(0);
            }
        }
    }
    Ok(())
}

/// The prefill tokens of a plan a mixed-step graph can replay, or None: `num_decode` >= 1
/// decoding requests lead the plan with `block_rows` rows and samples each, then at most
/// `max_prefill_requests` prefill chunks, each sampling nothing or its chunk's last row.
/// (`qsl`: R+1 row offsets; `sample_start`: R+1 offsets into `sample_rows`.)
pub fn mixed_prefill_tokens(
    qsl: &[i32],
    sample_start: &[i64],
    sample_rows: &[i64],
    num_decode: usize,
    block_rows: usize,
    max_prefill_requests: usize,
) -> Option<usize> {
    let r = qsl.len().checked_sub(1)?;
    let rd = num_decode;
    if rd == 0 || rd > r || r - rd > max_prefill_requests || sample_start.len() != r + 1 {
        return None;
    }
    let lead = (rd * block_rows) as i64;
    if qsl[rd] as i64 != lead || sample_start[rd] != lead {
        return None;
    }
    for j in rd..r {
        match sample_start[j + 1] - sample_start[j] {
            0 => {}
            1 => {
                let row = *sample_rows.get(usize::try_from(sample_start[j]).ok()?)?;
                if row != qsl[j + 1] as i64 - 1 {
                    return None;
                }
            }
            _ => return None,
        }
    }
    usize::try_from(qsl[r] as i64 - lead).ok()
}

/// A mixed plan's rows in bucket `bs`'s slots. `srows` (the graph's sample rows, one per
/// slot: bs*B + prefill slots): decoding slot i's block is rows i*B.. for i < rd and, for a
/// padding slot, distinct rows past the plan's (from `qsl[R]` on); each prefill slot j the
/// last row of chunk rd+j (0 where no chunk). `vrows` (bs*(B-1)): rows 1..B of every slot's
/// block (the verified drafts). Returns each plan sample row's slot.
pub fn stage_mixed_rows(
    srows: &mut [i64],
    vrows: &mut [i64],
    qsl: &[i32],
    sample_start: &[i64],
    num_decode: usize,
    bs: usize,
    block_rows: usize,
) -> Result<Vec<i64>, String> {
    let (b, rd) = (block_rows, num_decode);
    let r = qsl.len().checked_sub(1).ok_or("empty query_start_loc")?;
    if rd > bs || rd > r || sample_start.len() != r + 1 || b == 0 {
        return Err(format!("a plan of {r} requests ({rd} decoding) does not fit bucket {bs} (B = {b})"));
    }
    if srows.len() < bs * b + (r - rd) || vrows.len() != bs * (b - 1) {
        return Err(format!(
            "sample rows {} / verify rows {} do not fit bucket {bs} (B = {b}) with {} prefill requests",
            srows.len(),
            vrows.len(),
            r - rd
        ));
    }
    let shift = qsl[r] as i64 - (rd * b) as i64; // padding slots' blocks start past the plan's rows
    for i in 0..bs {
        let base = (i * b) as i64 + if i < rd { 0 } else { shift };
        for j in 0..b {
            srows[i * b + j] = base + j as i64;
            if j > 0 {
                vrows[i * (b - 1) + j - 1] = base + j as i64;
            }
        }
    }
    let prefill = &mut srows[bs * b..];
    prefill.fill(0);
    for j in 0..r - rd {
        prefill[j] = qsl[rd + j + 1] as i64 - 1;
    }
    let mut slot_of: Vec<i64> = (0..(rd * b) as i64).collect();
    for j in 0..r - rd {
        if sample_start[rd + j + 1] > sample_start[rd + j] {
            slot_of.push((bs * b + j) as i64);
        }
    }
    Ok(slot_of)
}

/// Request i's sample slots in a step: `sample_start[i]..sample_start[i+1]` (a decode step,
/// and a mixed step's decoding requests), or for a mixed step (`mixed = (num_decode, base)`)
/// prefill request rd+j's one slot `base + j`.
fn sample_slots(sample_start: &[i64], mixed: Option<(usize, usize)>, i: usize) -> (usize, usize) {
    match mixed {
        Some((rd, base)) if i >= rd => {
            let n = (sample_start[i + 1] - sample_start[i]) as usize;
            (base + i - rd, base + i - rd + n)
        }
        _ => (sample_start[i] as usize, sample_start[i + 1] as usize),
    }
}

/// Whether `r` per-request values fit `slots` sample slots (see `stage_sampling`): the checks
/// a caller staging several fields runs for all of them before writing any.
pub fn check_sampling(
    slots: usize,
    r: usize,
    sample_start: &[i64],
    mixed: Option<(usize, usize)>,
) -> Result<(), String> {
    if sample_start.len() != r + 1 {
        return Err(format!("{r} values for {} requests", sample_start.len().saturating_sub(1)));
    }
    if sample_start.first().is_some_and(|&s| s < 0) || sample_start.windows(2).any(|w| w[1] < w[0]) {
        return Err("sample_start is not a non-negative, non-decreasing offset array".into());
    }
    for i in 0..r {
        let (lo, hi) = sample_slots(sample_start, mixed, i);
        if hi > slots {
            return Err(format!("request {i}'s sample slots {lo}..{hi} fall outside {slots} slots"));
        }
        if let Some((rd, _)) = mixed {
            if i >= rd && hi - lo > 1 {
                return Err(format!("prefill request {i} samples {} rows (at most 1 in a mixed graph)", hi - lo));
            }
        }
    }
    Ok(())
}

/// One sampling parameter in every sample slot of `out`: `pad` everywhere, then request i's
/// value in its sample slots (`sample_slots`). Checks first (`check_sampling`); writes nothing
/// when refused.
pub fn stage_sampling<T: Copy>(
    out: &mut [T],
    values: &[T],
    pad: T,
    sample_start: &[i64],
    mixed: Option<(usize, usize)>,
) -> Result<(), String> {
    check_sampling(out.len(), values.len(), sample_start, mixed)?;
    out.fill(pad);
    for (i, &v) in values.iter().enumerate() {
        let (lo, hi) = sample_slots(sample_start, mixed, i);
        out[lo..hi].fill(v);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A mixed plan: rd decoding requests of b rows (all sampled), then prefill chunks.
    fn mixed_plan(rd: usize, b: usize, chunks: &[(usize, bool)]) -> (Vec<i32>, Vec<i64>, Vec<i64>) {
        let (mut qsl, mut ss, mut rows) = (vec![0i32], vec![0i64], vec![]);
        for _ in 0..rd {
            let at = *qsl.last().unwrap();
            rows.extend((at..at + b as i32).map(i64::from));
            qsl.push(at + b as i32);
            ss.push(rows.len() as i64);
        }
        for &(n, sampled) in chunks {
            let at = *qsl.last().unwrap();
            qsl.push(at + n as i32);
            if sampled {
                rows.push((at + n as i32 - 1) as i64);
            }
            ss.push(rows.len() as i64);
        }
        (qsl, ss, rows)
    }

    #[test]
    fn mixed_shapes_a_graph_replays_and_those_it_does_not() {
        let (q, s, rows) = mixed_plan(3, 4, &[(5, true), (6, false)]);
        assert_eq!(mixed_prefill_tokens(&q, &s, &rows, 3, 4, 4), Some(11));
        assert_eq!(mixed_prefill_tokens(&q, &s, &rows, 3, 4, 1), None, "too many prefill requests");
        assert_eq!(mixed_prefill_tokens(&q, &s, &rows, 0, 4, 4), None, "no decoding request");
        assert_eq!(mixed_prefill_tokens(&q, &s, &rows, 3, 5, 4), None, "other block rows");
        let mut bad = rows.clone();
        *bad.last_mut().unwrap() -= 1; // a prefill chunk sampling a row that is not its last
        assert_eq!(mixed_prefill_tokens(&q, &s, &bad, 3, 4, 4), None);
        let (q2, mut s2, mut rows2) = mixed_plan(2, 4, &[(5, true)]);
        rows2.push(3); // a prefill chunk sampling two rows
        *s2.last_mut().unwrap() += 1;
        assert_eq!(mixed_prefill_tokens(&q2, &s2, &rows2, 2, 4, 4), None);
    }

    #[test]
    fn stage_sampling_refuses_what_does_not_fit() {
        let mut out = [0i64; 8];
        assert!(stage_sampling(&mut out, &[1, 2], 9, &[0, 4, 8], None).is_ok());
        assert_eq!(out, [1, 1, 1, 1, 2, 2, 2, 2]);
        assert!(stage_sampling(&mut out, &[1, 2], 9, &[0, 4, 9], None).is_err());
        assert!(stage_sampling(&mut out, &[1], 9, &[0, 4, 8], None).is_err());
        assert!(stage_sampling(&mut out, &[1, 2], 9, &[0, 4, 3], Some((1, 4))).is_err(), "decreasing offsets");
        assert!(
            stage_sampling(&mut out, &[1, 2], 9, &[0, 4, 6], Some((1, 4))).is_err(),
            "two samples in a prefill slot"
        );
        assert_eq!(out, [1, 1, 1, 1, 2, 2, 2, 2], "nothing written when refused");
    }

    proptest! {
        /// Against the graph runner's former numpy staging: random mixed plans and buckets.
        #[test]
        fn mixed_rows_and_sampling_match_a_reference(
            rd in 1usize..6, extra in 0usize..4, b in 1usize..6,
            chunks in prop::collection::vec((1usize..9, any::<bool>()), 0..4),
            vals in prop::collection::vec(-50i64..50, 10),
        ) {
            let bs = rd + extra;
            let (q, s, rows) = mixed_plan(rd, b, &chunks);
            let r = q.len() - 1;
            prop_assert_eq!(mixed_prefill_tokens(&q, &s, &rows, rd, b, 4), if chunks.len() <= 4 {
                Some(chunks.iter().map(|c| c.0).sum::<usize>()) } else { None });
            let ns = bs * b + 4;
            let (mut srows, mut vrows) = (vec![-7i64; ns], vec![-7i64; bs * (b - 1)]);
            let slot_of = stage_mixed_rows(&mut srows, &mut vrows, &q, &s, rd, bs, b).unwrap();
            // reference: blocks = arange(bs*b).reshape(bs, b); blocks[rd:] += rows - rd*b
            let total = q[r] as i64;
            for i in 0..bs {
                for j in 0..b {
                    let want = (i * b + j) as i64 + if i >= rd { total - (rd * b) as i64 } else { 0 };
                    prop_assert_eq!(srows[i * b + j], want);
                    if j > 0 { prop_assert_eq!(vrows[i * (b - 1) + j - 1], want); }
                }
            }
            for j in 0..4 {
                let want = if j < r - rd { q[rd + j + 1] as i64 - 1 } else { 0 };
                prop_assert_eq!(srows[bs * b + j], want);
            }
            let mut want_slots: Vec<i64> = (0..(rd * b) as i64).collect();
            want_slots.extend(chunks.iter().enumerate().filter(|c| c.1 .1).map(|(j, _)| (bs * b + j) as i64));
            prop_assert_eq!(&slot_of, &want_slots);
            // sampling: each plan sample row's value lands in its slot, padding elsewhere
            let per_req: Vec<i64> = (0..r).map(|i| vals[i % vals.len()]).collect();
            let mut out = vec![0i64; ns];
            stage_sampling(&mut out, &per_req, 99, &s, Some((rd, bs * b))).unwrap();
            let mut want = vec![99i64; ns];
            for i in 0..r {
                for k in s[i]..s[i + 1] {
                    want[slot_of[k as usize] as usize] = per_req[i];
                }
            }
            prop_assert_eq!(out, want);
        }
    }
}
