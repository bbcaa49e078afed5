//! Thin PyO3 layer: converts, never decides. Arrays cross as numpy buffers that take
//! ownership of the Rust vectors (no copy).

use numpy::{IntoPyArray, PyArray1, PyArray2, PyArrayMethods, PyReadonlyArray1};
use pyo3::prelude::*;

use crate::error::CoreError;
use crate::plan::{EntryKind, PlanEntry, StepPlan};
use crate::request::{FinishReason, Phase};
use crate::scheduler::{Scheduler, SchedulerConfig};

mod exc {
    use pyo3::create_exception;
    use pyo3::exceptions::PyException;
    create_exception!(_core, CoreError, PyException, "Base class of every dflash_engine._core error.");
    create_exception!(_core, InvalidConfigError, CoreError, "Scheduler configuration is invalid.");
    create_exception!(_core, RequestRejectedError, CoreError, "The request can never be served.");
    create_exception!(_core, DuplicateRequestError, CoreError, "The request id is already live.");
    create_exception!(_core, UnknownRequestError, CoreError, "No live request has this handle.");
    create_exception!(_core, PlanOutstandingError, CoreError, "The previous plan is not committed or cancelled.");
    create_exception!(_core, StalePlanError, CoreError, "The plan is not the outstanding one, or its requests changed.");
    create_exception!(_core, InvalidCommitError, CoreError, "Step results do not fit the plan.");
}

fn to_py(e: CoreError) -> PyErr {
    let msg = e.to_string();
    match e {
        CoreError::InvalidConfig(_) => exc::InvalidConfigError::new_err(msg),
        CoreError::Rejected { .. } => exc::RequestRejectedError::new_err(msg),
        CoreError::DuplicateRequest(_) => exc::DuplicateRequestError::new_err(msg),
        CoreError::UnknownRequest(_) => exc::UnknownRequestError::new_err(msg),
        CoreError::PlanOutstanding { .. } => exc::PlanOutstandingError::new_err(msg),
        CoreError::StalePlan(_) => exc::StalePlanError::new_err(msg),
        CoreError::InvalidCommit(_) => exc::InvalidCommitError::new_err(msg),
    }
}

fn parse_reason(reason: &str) -> PyResult<FinishReason> {
    Ok(match reason {
        "stop" => FinishReason::Stop,
        "length" => FinishReason::Length,
        "abort" => FinishReason::Abort,
        "error" => FinishReason::Error,
        other => {
            return Err(pyo3::exceptions::PyValueError::new_err(format!(
                "unknown finish reason {other:?} (stop, length, abort, error)"
            )))
        }
    })
}

/// Accepts an int64 numpy array (fast path) or any sequence of ints.
fn u32_vec(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Vec<u32>> {
    let conv = |v: i64| {
        u32::try_from(v).map_err(|_| exc::InvalidCommitError::new_err(format!("{what}: value {v} out of range")))
    };
    match obj.extract::<PyReadonlyArray1<'_, i64>>() {
        Ok(a) => a.as_slice()?.iter().map(|&v| conv(v)).collect(),
        Err(_) => obj.extract::<Vec<i64>>()?.into_iter().map(conv).collect(),
    }
}

fn arr1<'py, T: numpy::Element>(py: Python<'py>, v: Vec<T>) -> Py<PyArray1<T>> {
    v.into_pyarray(py).unbind()
}

fn arr2(py: Python<'_>, v: Vec<i32>, rows: usize, cols: usize) -> PyResult<Py<PyArray2<i32>>> {
    Ok(v.into_pyarray(py).reshape([rows, cols])?.unbind())
}

#[pyclass(name = "StepPlan", module = "dflash_engine._core", frozen)]
pub struct PyStepPlan {
    plan: StepPlan,
    #[pyo3(get)]
    step_id: u64,
    #[pyo3(get)]
    block_rows: usize,
    #[pyo3(get)]
    handles: Py<PyArray1<u64>>,
    #[pyo3(get)]
    num_drafts: Py<PyArray1<i64>>,
    #[pyo3(get)]
    sample_start: Py<PyArray1<i64>>,
    #[pyo3(get)]
    input_ids: Py<PyArray1<i64>>,
    #[pyo3(get)]
    positions: Py<PyArray1<i64>>,
    #[pyo3(get)]
    slot_mapping: Py<PyArray1<i64>>,
    #[pyo3(get)]
    query_start_loc: Py<PyArray1<i32>>,
    #[pyo3(get)]
    seq_lens: Py<PyArray1<i32>>,
    #[pyo3(get)]
    block_tables: Py<PyArray2<i32>>,
    #[pyo3(get)]
    sample_rows: Py<PyArray1<i64>>,
    #[pyo3(get)]
    draft_input_ids: Py<PyArray1<i64>>,
    #[pyo3(get)]
    draft_positions: Py<PyArray1<i64>>,
    #[pyo3(get)]
    draft_slot_mapping: Py<PyArray1<i64>>,
    #[pyo3(get)]
    draft_query_start_loc: Py<PyArray1<i32>>,
    #[pyo3(get)]
    draft_seq_lens: Py<PyArray1<i32>>,
    #[pyo3(get)]
    draft_block_tables: Py<PyArray2<i32>>,
    #[pyo3(get)]
    draft_entry: Py<PyArray1<i64>>,
    #[pyo3(get)]
    verify_target_rows: Py<PyArray1<i64>>,
    #[pyo3(get)]
    verify_draft_rows: Py<PyArray1<i64>>,
    #[pyo3(get)]
    preempted: Py<PyArray1<u64>>,
}

/// `arr[:n]` as a numpy view (no copy).
fn prefix<'py, T: numpy::Element, D: numpy::ndarray::Dimension>(
    arr: &Py<numpy::PyArray<T, D>>,
    py: Python<'py>,
    n: usize,
) -> PyResult<Py<numpy::PyArray<T, D>>> {
    let view = arr.bind(py).get_item(pyo3::types::PySlice::new(py, 0, n as isize, 1))?;
    Ok(view.downcast_into::<numpy::PyArray<T, D>>()?.unbind())
}

impl PyStepPlan {
    fn new(py: Python<'_>, mut plan: StepPlan) -> PyResult<Self> {
        let r = plan.entries.len();
        let (nd, nd_rows) = (plan.num_decode, plan.num_draft_rows());
        let handles = plan.entries.iter().map(|e| e.handle).collect();
        let num_drafts = plan.entries.iter().map(|e| e.num_drafts() as i64).collect();
        let mut sample_start: Vec<i64> = plan.entries.iter().map(|e| e.sample_start as i64).collect();
        sample_start.push(plan.num_sample_rows() as i64);
        let t = std::mem::take(&mut plan.target);
        let input_ids = arr1(py, t.input_ids);
        let positions = arr1(py, t.positions);
        let slot_mapping = arr1(py, t.slot_mapping);
        let query_start_loc = arr1(py, t.query_start_loc);
        let seq_lens = arr1(py, t.seq_lens);
        let block_tables = arr2(py, t.block_tables, r, t.max_pages)?;
        let verify_target_rows = arr1(py, std::mem::take(&mut plan.verify_target_rows));
        // The draft pass is the leading decode requests of the target pass (see plan.rs): views.
        // The runner fills drafts into its own device copy of input_ids, never into these.
        Ok(PyStepPlan {
            step_id: plan.step_id,
            block_rows: plan.block_rows,
            handles: arr1(py, handles),
            num_drafts: arr1(py, num_drafts),
            sample_start: arr1(py, sample_start),
            draft_input_ids: prefix(&input_ids, py, nd_rows)?,
            draft_positions: prefix(&positions, py, nd_rows)?,
            draft_slot_mapping: prefix(&slot_mapping, py, nd_rows)?,
            draft_query_start_loc: prefix(&query_start_loc, py, nd + 1)?,
            draft_seq_lens: prefix(&seq_lens, py, nd)?,
            draft_block_tables: prefix(&block_tables, py, nd)?,
            draft_entry: arr1(py, (0..nd as i64).collect()),
            verify_draft_rows: verify_target_rows.clone_ref(py),
            input_ids,
            positions,
            slot_mapping,
            query_start_loc,
            seq_lens,
            block_tables,
            verify_target_rows,
            sample_rows: arr1(py, std::mem::take(&mut plan.sample_rows)),
            preempted: arr1(py, std::mem::take(&mut plan.preempted)),
            plan,
        })
    }
}

fn kind_tuple(e: &PlanEntry) -> (&'static str, usize, usize, bool) {
    match e.kind {
        EntryKind::Prefill { start, len, sample } => ("prefill", start, len, sample),
        EntryKind::Decode { committed } => ("decode", committed, e.num_samples, true),
    }
}

#[pymethods]
impl PyStepPlan {
    fn __len__(&self) -> usize {
        self.plan.entries.len()
    }

    #[getter]
    fn num_rows(&self) -> usize {
        self.plan.entries.iter().map(|e| match e.kind {
            EntryKind::Prefill { len, .. } => len,
            EntryKind::Decode { .. } => e.num_samples,
        }).sum()
    }

    #[getter]
    fn num_decode(&self) -> usize {
        self.plan.num_decode
    }

    /// Per request: (kind, start_or_committed, rows, samples_at_end).
    fn entries(&self) -> Vec<(u64, &'static str, usize, usize, bool)> {
        self.plan.entries.iter().map(|e| {
            let (k, a, b, c) = kind_tuple(e);
            (e.handle, k, a, b, c)
        }).collect()
    }

    /// Target rows whose tap hidden states become draft context given the accepted counts.
    fn context_rows<'py>(&self, py: Python<'py>, accepted: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyArray1<i64>>> {
        let acc = u32_vec(accepted, "accepted")?;
        let rows = self.plan.context_rows(&acc).map_err(exc::InvalidCommitError::new_err)?;
        Ok(rows.into_pyarray(py))
    }

    fn __repr__(&self) -> String {
        format!("StepPlan(step_id={}, requests={}, block_rows={})", self.step_id, self.plan.entries.len(), self.block_rows)
    }
}

/// (handle, new token ids, finish reason or None)
type CommitItem = (u64, Vec<i64>, Option<&'static str>);

#[pyclass(name = "CommitResult", module = "dflash_engine._core", frozen)]
pub struct PyCommitResult {
    #[pyo3(get)]
    handles: Py<PyArray1<u64>>,
    /// R+1 offsets into `new_tokens`.
    #[pyo3(get)]
    offsets: Py<PyArray1<i64>>,
    #[pyo3(get)]
    new_tokens: Py<PyArray1<i64>>,
    /// 0 running, 1 stop, 2 length, 3 abort, 4 error.
    #[pyo3(get)]
    finish_codes: Py<PyArray1<u8>>,
}

#[pymethods]
impl PyCommitResult {
    fn __len__(&self, py: Python<'_>) -> PyResult<usize> {
        self.handles.bind(py).len()
    }

    /// `[(handle, new_token_ids, finish_reason or None)]`
    fn items(&self, py: Python<'_>) -> PyResult<Vec<CommitItem>> {
        let handles = self.handles.bind(py).readonly();
        let offsets = self.offsets.bind(py).readonly();
        let tokens = self.new_tokens.bind(py).readonly();
        let codes = self.finish_codes.bind(py).readonly();
        let (h, o, t, c) = (handles.as_slice()?, offsets.as_slice()?, tokens.as_slice()?, codes.as_slice()?);
        Ok((0..h.len())
            .map(|i| (h[i], t[o[i] as usize..o[i + 1] as usize].to_vec(), FinishReason::NAMES[c[i] as usize]))
            .collect())
    }
}

#[pyclass(name = "Scheduler", module = "dflash_engine._core")]
pub struct PyScheduler {
    inner: Scheduler,
}

#[pymethods]
impl PyScheduler {
    #[new]
    #[pyo3(signature = (*, num_pages, block_size, max_num_seqs, max_num_batched_tokens, max_model_len,
                        num_speculative_tokens = 0, mask_token_id = 0))]
    fn new(
        num_pages: usize,
        block_size: usize,
        max_num_seqs: usize,
        max_num_batched_tokens: usize,
        max_model_len: usize,
        num_speculative_tokens: usize,
        mask_token_id: u32,
    ) -> PyResult<Self> {
        let cfg = SchedulerConfig {
            num_pages,
            block_size,
            max_num_seqs,
            max_num_batched_tokens,
            max_model_len,
            num_speculative_tokens,
            mask_token_id,
        };
        Ok(PyScheduler { inner: Scheduler::new(cfg).map_err(to_py)? })
    }

    #[pyo3(signature = (request_id, prompt_token_ids, max_tokens, stop_token_ids = None))]
    fn add_request(
        &mut self,
        request_id: &str,
        prompt_token_ids: &Bound<'_, PyAny>,
        max_tokens: usize,
        stop_token_ids: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<u64> {
        let prompt = u32_vec(prompt_token_ids, "prompt_token_ids").map_err(|e| {
            exc::RequestRejectedError::new_err(format!("request {request_id:?} rejected: {e}"))
        })?;
        let stops = match stop_token_ids {
            Some(s) => u32_vec(s, "stop_token_ids")?,
            None => Vec::new(),
        };
        self.inner.add_request(request_id, prompt, max_tokens, stops).map_err(to_py)
    }

    fn handle_of(&self, request_id: &str) -> Option<u64> {
        self.inner.handle_of(request_id)
    }

    fn abort(&mut self, handle: u64) -> PyResult<()> {
        self.inner.finish(handle, FinishReason::Abort).map_err(to_py)
    }

    fn finish(&mut self, handle: u64, reason: &str) -> PyResult<()> {
        self.inner.finish(handle, parse_reason(reason)?).map_err(to_py)
    }

    fn schedule(&mut self, py: Python<'_>) -> PyResult<PyStepPlan> {
        let plan = self.inner.schedule().map_err(to_py)?;
        PyStepPlan::new(py, plan)
    }

    fn commit(
        &mut self,
        py: Python<'_>,
        plan: &PyStepPlan,
        accepted: &Bound<'_, PyAny>,
        sampled: &Bound<'_, PyAny>,
    ) -> PyResult<PyCommitResult> {
        let acc = u32_vec(accepted, "accepted")?;
        let smp = u32_vec(sampled, "sampled")?;
        let b = self.inner.commit_batch(&plan.plan, &acc, &smp).map_err(to_py)?;
        Ok(PyCommitResult {
            handles: arr1(py, b.handles),
            offsets: arr1(py, b.offsets),
            new_tokens: arr1(py, b.tokens),
            finish_codes: arr1(py, b.finish),
        })
    }

    fn cancel(&mut self, plan: &PyStepPlan) -> PyResult<()> {
        self.inner.cancel(&plan.plan).map_err(to_py)
    }

    #[pyo3(signature = (plan, reason = "error"))]
    fn fail(&mut self, plan: &PyStepPlan, reason: &str) -> PyResult<Vec<u64>> {
        self.inner.fail(&plan.plan, parse_reason(reason)?).map_err(to_py)
    }

    /// (phase, computed-or-committed, tokens) of a live request.
    fn request_state(&self, handle: u64) -> PyResult<(&'static str, usize, Vec<u32>)> {
        let r = self
            .inner
            .request(handle)
            .ok_or_else(|| to_py(CoreError::UnknownRequest(format!("handle {handle}"))))?;
        let n = match r.phase {
            Phase::Prefilling { computed } => computed,
            Phase::Decoding { committed, .. } => committed,
            _ => 0,
        };
        Ok((r.phase.name(), n, r.tokens.clone()))
    }

    fn check_invariants(&self) -> PyResult<()> {
        self.inner.check_invariants().map_err(|m| exc::CoreError::new_err(format!("invariant violated: {m}")))
    }

    #[getter]
    fn num_running(&self) -> usize {
        self.inner.num_running()
    }
    #[getter]
    fn num_waiting(&self) -> usize {
        self.inner.num_waiting()
    }
    #[getter]
    fn num_live(&self) -> usize {
        self.inner.num_live()
    }
    #[getter]
    fn num_free_pages(&self) -> usize {
        self.inner.num_free_pages()
    }
    #[getter]
    fn num_usable_pages(&self) -> usize {
        self.inner.pool().num_usable()
    }
    #[getter]
    fn kv_usage(&self) -> f64 {
        self.inner.kv_usage()
    }
    #[getter]
    fn num_preemptions(&self) -> u64 {
        self.inner.num_preemptions()
    }
    #[getter]
    fn block_size(&self) -> usize {
        self.inner.config().block_size
    }
    #[getter]
    fn block_rows(&self) -> usize {
        self.inner.config().block_rows()
    }
    #[getter]
    fn outstanding_step(&self) -> Option<u64> {
        self.inner.outstanding_step()
    }
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add_class::<PyScheduler>()?;
    m.add_class::<PyStepPlan>()?;
    m.add_class::<PyCommitResult>()?;
    m.add("CoreError", py.get_type::<exc::CoreError>())?;
    m.add("InvalidConfigError", py.get_type::<exc::InvalidConfigError>())?;
    m.add("RequestRejectedError", py.get_type::<exc::RequestRejectedError>())?;
    m.add("DuplicateRequestError", py.get_type::<exc::DuplicateRequestError>())?;
    m.add("UnknownRequestError", py.get_type::<exc::UnknownRequestError>())?;
    m.add("PlanOutstandingError", py.get_type::<exc::PlanOutstandingError>())?;
    m.add("StalePlanError", py.get_type::<exc::StalePlanError>())?;
    m.add("InvalidCommitError", py.get_type::<exc::InvalidCommitError>())?;
    m.add("NULL_PAGE", crate::block_pool::NULL_PAGE)?;
    m.add("FINISH_REASONS", FinishReason::NAMES.to_vec())?;
    Ok(())
}
