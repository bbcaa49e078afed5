//! Thin PyO3 layer: converts, never decides. Arrays cross as numpy buffers that take
//! ownership of the Rust vectors (no copy).

use std::sync::Mutex;

use numpy::{IntoPyArray, PyArray1, PyArray2, PyArrayMethods, PyReadonlyArray1, PyReadonlyArray2, PyReadwriteArray1};
use pyo3::prelude::*;
use pyo3::sync::GILOnceCell;
use pyo3::types::{PyDict, PyTuple, PyType};

use crate::draft_len::{draft_len_for, DraftLenPolicy, StepCosts};
use crate::error::{CoreError, Param};
use crate::plan::{StepPlan, StepTicket};
use crate::request::FinishReason;
use crate::scheduler::{pages_per_seq, state_slots_per_seq, MixedStepLimit, Scheduler, SchedulerConfig};

mod exc {
    use pyo3::create_exception;
    use pyo3::exceptions::PyException;
    create_exception!(_core, CoreError, PyException, "Base class of every dflash_engine._core error.");
    create_exception!(_core, InvalidConfigError, CoreError, "Scheduler configuration is invalid.");
    create_exception!(_core, DuplicateRequestError, CoreError, "The request id is already live.");
    create_exception!(_core, UnknownRequestError, CoreError, "No live request has this handle.");
    create_exception!(_core, PlanOutstandingError, CoreError, "The previous plan is not committed or cancelled.");
    create_exception!(_core, StalePlanError, CoreError, "The plan's ticket is spent or belongs to another scheduler.");
    create_exception!(_core, InvalidCommitError, CoreError, "Step results do not fit the plan.");
}

/// `RequestRejectedError(CoreError, ValueError)`: bad input is a ValueError to callers that
/// know nothing of the core; `.param` names the request parameter (OpenAI's name).
static REQUEST_REJECTED: GILOnceCell<Py<PyType>> = GILOnceCell::new();

fn request_rejected_type(py: Python<'_>) -> PyResult<&Bound<'_, PyType>> {
    REQUEST_REJECTED
        .get_or_try_init(py, || {
            let bases = PyTuple::new(
                py,
                [
                    py.get_type::<exc::CoreError>().into_any(),
                    py.get_type::<pyo3::exceptions::PyValueError>().into_any(),
                ],
            )?;
            let ns = PyDict::new(py);
            ns.set_item("__doc__", "The request can never be served; `param` names the offending parameter.")?;
            ns.set_item("__module__", "dflash_engine._core")?;
            ns.set_item("param", py.None())?;
            let ty = py.import("builtins")?.getattr("type")?.call1(("RequestRejectedError", bases, ns))?;
            Ok(ty.downcast_into::<PyType>()?.unbind())
        })
        .map(|t| t.bind(py))
}

fn rejected(py: Python<'_>, param: Param, msg: String) -> PyErr {
    let build = || -> PyResult<PyErr> {
        let err = request_rejected_type(py)?.call1((msg.clone(),))?;
        err.setattr("param", param.as_str())?;
        Ok(PyErr::from_value(err))
    };
    build().unwrap_or_else(|e| e)
}

fn to_py(e: CoreError) -> PyErr {
    let msg = e.to_string();
    match e {
        CoreError::InvalidConfig(_) => exc::InvalidConfigError::new_err(msg),
        CoreError::Rejected { param, .. } => Python::with_gil(|py| rejected(py, param, msg)),
        CoreError::DuplicateRequest(_) => exc::DuplicateRequestError::new_err(msg),
        CoreError::UnknownRequest(_) => exc::UnknownRequestError::new_err(msg),
        CoreError::PlanOutstanding { .. } => exc::PlanOutstandingError::new_err(msg),
        CoreError::StalePlan(_) => exc::StalePlanError::new_err(msg),
        CoreError::InvalidCommit(_) => exc::InvalidCommitError::new_err(msg),
    }
}

/// Non-negative integers, a negative one a `ValueError` naming `what`.
fn counts_vec(v: Vec<i64>, what: &str) -> PyResult<Vec<usize>> {
    v.into_iter()
        .map(|x| {
            usize::try_from(x).map_err(|_| pyo3::exceptions::PyValueError::new_err(format!("{what}: {x} is negative")))
        })
        .collect()
}

/// The draft-length policy by name. A non-empty `schedule` with "fixed" (the default) is the
/// Schedule policy (the keyword that predates the policy); "adaptive" with no candidates
/// considers every k in 0..=k_max.
fn parse_policy(
    name: &str,
    schedule: Vec<(usize, usize)>,
    candidates: Vec<usize>,
    k_max: usize,
) -> PyResult<DraftLenPolicy> {
    let err = |m: String| Err(pyo3::exceptions::PyValueError::new_err(m));
    match name {
        "fixed" | "schedule" if !candidates.is_empty() => {
            err(format!("draft_len_candidates need draft_len_policy='adaptive', not {name:?}"))
        }
        "fixed" if schedule.is_empty() => Ok(DraftLenPolicy::Fixed),
        "schedule" if schedule.is_empty() => {
            err("draft_len_policy='schedule' needs a non-empty draft_len_schedule".into())
        }
        "fixed" | "schedule" => Ok(DraftLenPolicy::Schedule(schedule)),
        "adaptive" if !schedule.is_empty() => {
            err("give either a draft_len_schedule or draft_len_policy='adaptive', not both".into())
        }
        "adaptive" if candidates.is_empty() => Ok(DraftLenPolicy::Adaptive { candidates: (0..=k_max).collect() }),
        "adaptive" => Ok(DraftLenPolicy::Adaptive { candidates }),
        other => err(format!("unknown draft_len_policy {other:?} (fixed, schedule, adaptive)")),
    }
}

fn parse_reason(reason: &str) -> PyResult<FinishReason> {
    FinishReason::from_name(reason).ok_or_else(|| {
        pyo3::exceptions::PyValueError::new_err(format!(
            "unknown finish reason {reason:?} (stop, length, abort, error)"
        ))
    })
}

/// Accepts an int64 numpy array (fast path) or any sequence of ints; a value outside u32
/// is reported through `err`.
fn u32_vec(obj: &Bound<'_, PyAny>, what: &str, err: impl Fn(String) -> PyErr) -> PyResult<Vec<u32>> {
    let conv = |v: i64| u32::try_from(v).map_err(|_| err(format!("{what}: value {v} out of range [0, 2^32)")));
    if let Ok(a) = obj.extract::<PyReadonlyArray1<'_, i64>>() {
        return a.as_slice()?.iter().map(|&v| conv(v)).collect();
    }
    match obj.extract::<Vec<i64>>() {
        Ok(v) => v.into_iter().map(conv).collect(),
        Err(_) => Err(err(format!("{what} must be a sequence of integers in [0, 2^32)"))),
    }
}

fn commit_error(what: &str) -> impl Fn(String) -> PyErr + '_ {
    move |m| exc::InvalidCommitError::new_err(format!("{what}: {m}"))
}

/// Clears a fresh array's WRITEABLE flag in place (numpy's C struct, as the numpy crate's
/// `make_nonwriteable` does): going through Python's `arr.flags.writeable = False` cost a
/// microsecond or two per array, ~20 arrays a plan, on the critical path between steps.
fn read_only<T: numpy::Element, D: numpy::ndarray::Dimension>(a: &Bound<'_, numpy::PyArray<T, D>>) {
    // SAFETY: `a` was created here and no reference into its data has been handed out; the
    // GIL is held (the Bound), so nothing else reads or writes its flags meanwhile.
    unsafe {
        (*numpy::PyUntypedArrayMethods::as_array_ptr(a)).flags &= !numpy::npyffi::flags::NPY_ARRAY_WRITEABLE;
    }
}

fn arr2(py: Python<'_>, v: Vec<i32>, rows: usize, cols: usize) -> PyResult<Py<PyArray2<i32>>> {
    let base = v.into_pyarray(py);
    read_only(&base);
    let a = base.reshape([rows, cols])?;
    read_only(&a);
    Ok(a.unbind())
}

/// `arr[:n]` as a numpy view (no copy; read-only like its base).
fn prefix<T: numpy::Element, D: numpy::ndarray::Dimension>(
    arr: &Py<numpy::PyArray<T, D>>,
    py: Python<'_>,
    n: usize,
) -> PyResult<Py<numpy::PyArray<T, D>>> {
    let view = arr.bind(py).get_item(pyo3::types::PySlice::new(py, 0, n as isize, 1))?;
    Ok(view.downcast_into::<numpy::PyArray<T, D>>()?.unbind())
}

/// One plan array as the core built it, made a read-only numpy array on first read and kept.
/// On the graph path Python reads only a few of a plan's arrays (the rest reach the pinned
/// staging buffer through `stage_into`, which reads the vectors), so a plan no longer makes
/// ~20 numpy arrays on the critical path between two steps.
struct Lazy<T: numpy::Element> {
    data: Vec<T>,
    array: GILOnceCell<Py<PyArray1<T>>>,
}

impl<T: numpy::Element + Copy> Lazy<T> {
    fn new(data: Vec<T>) -> Self {
        Lazy { data, array: GILOnceCell::new() }
    }

    fn get(&self, py: Python<'_>) -> PyResult<Py<PyArray1<T>>> {
        let a = self.array.get_or_try_init(py, || -> PyResult<_> {
            let a = PyArray1::from_slice(py, &self.data);
            read_only(&a);
            Ok(a.unbind())
        })?;
        Ok(a.clone_ref(py))
    }
}

/// One step's arrays (read-only numpy, made on first read) and, inside, the ticket `commit`
/// consumes.
#[pyclass(name = "StepPlan", module = "dflash_engine._core", frozen)]
pub struct PyStepPlan {
    ticket: Mutex<Option<StepTicket>>,
    #[pyo3(get)]
    step_id: u64,
    #[pyo3(get)]
    block_rows: usize,
    #[pyo3(get)]
    num_decode: usize,
    /// D: rows per draft block (0: no draft pass this step). The draft pass's arrays follow.
    #[pyo3(get)]
    draft_rows: usize,
    handles: Lazy<u64>,
    num_drafts: Lazy<i64>,
    /// R+1 offsets into `sample_rows`.
    sample_start: Lazy<i64>,
    input_ids: Lazy<i64>,
    positions: Lazy<i64>,
    slot_mapping: Lazy<i64>,
    query_start_loc: Lazy<i32>,
    seq_lens: Lazy<i32>,
    /// Row-major `[R, max_pages]` (`page_tables`, 2-D); `draft_page_tables` is a view of its
    /// first `num_decode` rows (none without a draft pass).
    page_tables: Lazy<i32>,
    max_pages: usize,
    page_tables_2d: GILOnceCell<Py<PyArray2<i32>>>,
    sample_rows: Lazy<i64>,
    draft_input_ids: Lazy<i64>,
    draft_positions: Lazy<i64>,
    draft_slot_mapping: Lazy<i64>,
    draft_query_start_loc: Lazy<i32>,
    draft_seq_lens: Lazy<i32>,
    /// Rows 1..B-1 of every draft block: the proposals.
    draft_proposal_rows: Lazy<i64>,
    verify_target_rows: Lazy<i64>,
    /// Hybrid targets: `[R]` each request's committed state slot (-1: none, zeros), and
    /// `[T]` the slot keeping the state after each target row (-1: not kept); else empty.
    state_read: Lazy<i64>,
    state_write: Lazy<i64>,
}

impl PyStepPlan {
    fn new(py: Python<'_>, ticket: StepTicket, plan: StepPlan) -> PyResult<Self> {
        Self::build(py, Some(ticket), plan)
    }

    fn build(_py: Python<'_>, ticket: Option<StepTicket>, mut plan: StepPlan) -> PyResult<Self> {
        let nd = plan.num_decode;
        let handles = plan.entries.iter().map(|e| e.handle).collect();
        let num_drafts = plan.entries.iter().map(|e| e.num_drafts() as i64).collect();
        let mut sample_start: Vec<i64> = plan.entries.iter().map(|e| e.sample_start as i64).collect();
        sample_start.push(plan.num_sample_rows() as i64);
        let t = std::mem::take(&mut plan.target);
        let dp = std::mem::take(&mut plan.draft);
        let d = dp.rows;
        let draft_qsl: Vec<i32> = (0..=if d > 0 { nd } else { 0 }).map(|i| (i * d) as i32).collect();
        Ok(PyStepPlan {
            ticket: Mutex::new(ticket),
            step_id: plan.step_id,
            block_rows: plan.block_rows,
            num_decode: nd,
            draft_rows: d,
            handles: Lazy::new(handles),
            num_drafts: Lazy::new(num_drafts),
            sample_start: Lazy::new(sample_start),
            input_ids: Lazy::new(t.input_ids),
            positions: Lazy::new(t.positions),
            slot_mapping: Lazy::new(t.slot_mapping),
            query_start_loc: Lazy::new(t.query_start_loc),
            seq_lens: Lazy::new(t.seq_lens),
            page_tables: Lazy::new(t.page_tables),
            max_pages: t.max_pages,
            page_tables_2d: GILOnceCell::new(),
            sample_rows: Lazy::new(std::mem::take(&mut plan.sample_rows)),
            draft_input_ids: Lazy::new(dp.input_ids),
            draft_positions: Lazy::new(dp.positions),
            draft_slot_mapping: Lazy::new(dp.slot_mapping),
            draft_query_start_loc: Lazy::new(draft_qsl),
            draft_seq_lens: Lazy::new(dp.seq_lens),
            draft_proposal_rows: Lazy::new(dp.proposal_rows),
            verify_target_rows: Lazy::new(std::mem::take(&mut plan.verify_target_rows)),
            state_read: Lazy::new(std::mem::take(&mut plan.state_read)),
            state_write: Lazy::new(std::mem::take(&mut plan.state_write)),
        })
    }

    /// The ticket, once; a second taker gets `StalePlanError`.
    fn take_ticket(&self) -> PyResult<StepTicket> {
        self.ticket.lock().unwrap_or_else(|e| e.into_inner()).take().ok_or_else(|| {
            exc::StalePlanError::new_err(format!("the ticket of step {} is already spent", self.step_id))
        })
    }

    fn return_ticket(&self, ticket: StepTicket) {
        *self.ticket.lock().unwrap_or_else(|e| e.into_inner()) = Some(ticket);
    }

    /// Requests in the plan.
    fn num_entries(&self) -> usize {
        self.handles.data.len()
    }

    fn tables_2d(&self, py: Python<'_>) -> PyResult<Py<PyArray2<i32>>> {
        let a = self
            .page_tables_2d
            .get_or_try_init(py, || arr2(py, self.page_tables.data.clone(), self.num_entries(), self.max_pages))?;
        Ok(a.clone_ref(py))
    }

    /// The one-dimensional plan array of this name (the Python attribute's), as the core's
    /// vector.
    fn array_named(&self, name: &str) -> Option<crate::staging::Src<'_>> {
        fn i64s(a: &Lazy<i64>) -> Option<crate::staging::Src<'_>> {
            Some(crate::staging::Src::I64(&a.data))
        }
        fn i32s(a: &Lazy<i32>) -> Option<crate::staging::Src<'_>> {
            Some(crate::staging::Src::I32(&a.data))
        }
        match name {
            "input_ids" => i64s(&self.input_ids),
            "positions" => i64s(&self.positions),
            "slot_mapping" => i64s(&self.slot_mapping),
            "query_start_loc" => i32s(&self.query_start_loc),
            "seq_lens" => i32s(&self.seq_lens),
            "sample_rows" => i64s(&self.sample_rows),
            "sample_start" => i64s(&self.sample_start),
            "draft_input_ids" => i64s(&self.draft_input_ids),
            "draft_positions" => i64s(&self.draft_positions),
            "draft_slot_mapping" => i64s(&self.draft_slot_mapping),
            "draft_query_start_loc" => i32s(&self.draft_query_start_loc),
            "draft_seq_lens" => i32s(&self.draft_seq_lens),
            "draft_proposal_rows" => i64s(&self.draft_proposal_rows),
            "verify_target_rows" => i64s(&self.verify_target_rows),
            "state_read" => i64s(&self.state_read),
            "state_write" => i64s(&self.state_write),
            _ => None,
        }
    }
}

#[pymethods]
impl PyStepPlan {
    fn __len__(&self) -> usize {
        self.num_entries()
    }

    /// Target rows of this step.
    #[getter]
    fn num_rows(&self) -> usize {
        self.input_ids.data.len()
    }

    fn __repr__(&self) -> String {
        format!("StepPlan(step_id={}, requests={}, block_rows={})", self.step_id, self.num_entries(), self.block_rows)
    }

    #[getter]
    fn handles(&self, py: Python<'_>) -> PyResult<Py<PyArray1<u64>>> {
        self.handles.get(py)
    }
    #[getter]
    fn num_drafts(&self, py: Python<'_>) -> PyResult<Py<PyArray1<i64>>> {
        self.num_drafts.get(py)
    }
    /// R+1 offsets into `sample_rows`.
    #[getter]
    fn sample_start(&self, py: Python<'_>) -> PyResult<Py<PyArray1<i64>>> {
        self.sample_start.get(py)
    }
    #[getter]
    fn input_ids(&self, py: Python<'_>) -> PyResult<Py<PyArray1<i64>>> {
        self.input_ids.get(py)
    }
    #[getter]
    fn positions(&self, py: Python<'_>) -> PyResult<Py<PyArray1<i64>>> {
        self.positions.get(py)
    }
    #[getter]
    fn slot_mapping(&self, py: Python<'_>) -> PyResult<Py<PyArray1<i64>>> {
        self.slot_mapping.get(py)
    }
    #[getter]
    fn query_start_loc(&self, py: Python<'_>) -> PyResult<Py<PyArray1<i32>>> {
        self.query_start_loc.get(py)
    }
    #[getter]
    fn seq_lens(&self, py: Python<'_>) -> PyResult<Py<PyArray1<i32>>> {
        self.seq_lens.get(py)
    }
    /// `[R, max_pages]`, padded with the null page.
    #[getter]
    fn page_tables(&self, py: Python<'_>) -> PyResult<Py<PyArray2<i32>>> {
        self.tables_2d(py)
    }
    /// Columns of `page_tables` (without making the array).
    #[getter]
    fn max_pages(&self) -> usize {
        self.max_pages
    }
    #[getter]
    fn sample_rows(&self, py: Python<'_>) -> PyResult<Py<PyArray1<i64>>> {
        self.sample_rows.get(py)
    }
    #[getter]
    fn draft_input_ids(&self, py: Python<'_>) -> PyResult<Py<PyArray1<i64>>> {
        self.draft_input_ids.get(py)
    }
    #[getter]
    fn draft_positions(&self, py: Python<'_>) -> PyResult<Py<PyArray1<i64>>> {
        self.draft_positions.get(py)
    }
    #[getter]
    fn draft_slot_mapping(&self, py: Python<'_>) -> PyResult<Py<PyArray1<i64>>> {
        self.draft_slot_mapping.get(py)
    }
    #[getter]
    fn draft_query_start_loc(&self, py: Python<'_>) -> PyResult<Py<PyArray1<i32>>> {
        self.draft_query_start_loc.get(py)
    }
    #[getter]
    fn draft_seq_lens(&self, py: Python<'_>) -> PyResult<Py<PyArray1<i32>>> {
        self.draft_seq_lens.get(py)
    }
    /// The first `num_decode` rows of `page_tables` (a view; none without a draft pass).
    #[getter]
    fn draft_page_tables(&self, py: Python<'_>) -> PyResult<Py<PyArray2<i32>>> {
        let rows = if self.draft_rows > 0 { self.num_decode } else { 0 };
        prefix(&self.tables_2d(py)?, py, rows)
    }
    /// Rows 1..B-1 of every draft block: the proposals.
    #[getter]
    fn draft_proposal_rows(&self, py: Python<'_>) -> PyResult<Py<PyArray1<i64>>> {
        self.draft_proposal_rows.get(py)
    }
    #[getter]
    fn verify_target_rows(&self, py: Python<'_>) -> PyResult<Py<PyArray1<i64>>> {
        self.verify_target_rows.get(py)
    }
    #[getter]
    fn state_read(&self, py: Python<'_>) -> PyResult<Py<PyArray1<i64>>> {
        self.state_read.get(py)
    }
    #[getter]
    fn state_write(&self, py: Python<'_>) -> PyResult<Py<PyArray1<i64>>> {
        self.state_write.get(py)
    }

    /// Copy the plan's one-dimensional arrays into `dst` (int64, e.g. a pinned staging
    /// buffer): for each `(name, at, total, pad)`, the array goes to `dst[at:at + len]` and
    /// `pad` fills `dst[at + len:at + total]` (`pad` None: the array's last value). With
    /// `pages = (at, width, rows_before, cols_before)`, the page tables go to the rows of
    /// `dst[at:]` (row stride `width`), and what the previous staging covered (its rows and
    /// columns) and this one does not is zeroed (the null page): everything outside this
    /// plan's tables is then 0 if it was before. One call instead of two numpy assignments
    /// per array (the graph runner's `_stage`, on the critical path between steps); it reads
    /// the core's vectors, so none of these arrays is made in numpy. Checks every field before
    /// writing any.
    #[pyo3(signature = (dst, fields, pages = None))]
    fn stage_into(
        &self,
        dst: &Bound<'_, PyArray1<i64>>,
        fields: Vec<(String, usize, usize, Option<i64>)>,
        pages: Option<(usize, usize, usize, usize)>,
    ) -> PyResult<()> {
        let err = |m: String| pyo3::exceptions::PyValueError::new_err(m);
        let mut staged = Vec::with_capacity(fields.len());
        for (name, at, total, pad) in &fields {
            let src =
                self.array_named(name).ok_or_else(|| err(format!("StepPlan has no one-dimensional array {name:?}")))?;
            staged.push((name.as_str(), src, *at, *total, *pad));
        }
        check_writeable(dst)?;
        // SAFETY: `dst` is checked writeable and contiguous, and the GIL (held throughout) keeps
        // Python code from touching it meanwhile. This skips the numpy crate's borrow tracking.
        let d = unsafe { dst.as_slice_mut() }.map_err(not_contiguous)?;
        let tables = pages.map(|(at, width, rb, cb)| {
            (self.page_tables.data.as_slice(), self.num_entries(), self.max_pages, at, width, rb, cb)
        });
        crate::staging::stage_arrays(d, &staged, tables).map_err(err)
    }
}

/// `dst` is a writeable array (the callers then take it as a mutable slice).
fn check_writeable(dst: &Bound<'_, PyArray1<i64>>) -> PyResult<()> {
    // SAFETY: reads the flags of a live array (the Bound), GIL held.
    let writeable = unsafe {
        (*numpy::PyUntypedArrayMethods::as_array_ptr(dst)).flags & numpy::npyffi::flags::NPY_ARRAY_WRITEABLE != 0
    };
    if !writeable {
        return Err(pyo3::exceptions::PyValueError::new_err("stage_into: dst is not writeable"));
    }
    Ok(())
}

fn not_contiguous(e: impl std::fmt::Display) -> PyErr {
    pyo3::exceptions::PyValueError::new_err(format!("stage_into: dst is not contiguous: {e}"))
}

/// One staged array from Python: int64 or int32, read-only borrowed.
enum PySrc<'py> {
    I64(PyReadonlyArray1<'py, i64>),
    I32(PyReadonlyArray1<'py, i32>),
}

/// `StepPlan.stage_into` for arrays held in Python (a tensor-parallel worker's copy of the
/// plan, WirePlan): `fields` = (name, array, at, total, pad); `pages` = (page tables [R, W]
/// int32, at, width, rows before, columns before). The same staging (staging::stage_arrays).
#[pyfunction]
#[pyo3(name = "stage_arrays", signature = (dst, fields, pages = None))]
#[allow(clippy::type_complexity)]
fn py_stage_arrays<'py>(
    mut dst: PyReadwriteArray1<'py, i64>,
    fields: Vec<(String, Bound<'py, PyAny>, usize, usize, Option<i64>)>,
    pages: Option<(PyReadonlyArray2<'py, i32>, usize, usize, usize, usize)>,
) -> PyResult<()> {
    let err = |m: String| pyo3::exceptions::PyValueError::new_err(m);
    let mut held = Vec::with_capacity(fields.len());
    for (name, a, _, _, _) in &fields {
        held.push(if let Ok(x) = a.extract::<PyReadonlyArray1<'py, i64>>() {
            PySrc::I64(x)
        } else if let Ok(x) = a.extract::<PyReadonlyArray1<'py, i32>>() {
            PySrc::I32(x)
        } else {
            return Err(err(format!("stage_arrays: {name} is not a 1-D int64 or int32 array")));
        });
    }
    let mut staged = Vec::with_capacity(fields.len());
    for ((name, _, at, total, pad), h) in fields.iter().zip(&held) {
        let src = match h {
            PySrc::I64(x) => crate::staging::Src::I64(x.as_slice()?),
            PySrc::I32(x) => crate::staging::Src::I32(x.as_slice()?),
        };
        staged.push((name.as_str(), src, *at, *total, *pad));
    }
    let tables = match &pages {
        Some((t, at, width, rb, cb)) => {
            let (rows, cols) = t.as_array().dim();
            Some((t.as_slice()?, rows, cols, *at, *width, *rb, *cb))
        }
        None => None,
    };
    // (borrow-tracked: a source that is `dst` itself is refused, not aliased)
    crate::staging::stage_arrays(dst.as_slice_mut().map_err(not_contiguous)?, &staged, tables).map_err(err)
}

/// (handle, new token ids, finish reason or None)
type CommitItem = (u64, Vec<i64>, Option<&'static str>);

/// A commit's results: the core's vectors, each a read-only numpy array on first read. The
/// engine reads them when it builds the outputs, which the overlapped step does after the next
/// launch: so making them is off the critical path between two steps.
#[pyclass(name = "CommitResult", module = "dflash_engine._core", frozen)]
pub struct PyCommitResult {
    handles: Lazy<u64>,
    /// R+1 offsets into `new_tokens`.
    offsets: Lazy<i64>,
    new_tokens: Lazy<i64>,
    /// 0 running, else an index into `FINISH_REASONS`.
    finish_codes: Lazy<u8>,
    /// Prompt tokens each request took from the prefix cache (at its first admission).
    num_cached_tokens: Lazy<u32>,
}

#[pymethods]
impl PyCommitResult {
    fn __len__(&self) -> usize {
        self.handles.data.len()
    }

    #[getter]
    fn handles(&self, py: Python<'_>) -> PyResult<Py<PyArray1<u64>>> {
        self.handles.get(py)
    }
    /// R+1 offsets into `new_tokens`.
    #[getter]
    fn offsets(&self, py: Python<'_>) -> PyResult<Py<PyArray1<i64>>> {
        self.offsets.get(py)
    }
    #[getter]
    fn new_tokens(&self, py: Python<'_>) -> PyResult<Py<PyArray1<i64>>> {
        self.new_tokens.get(py)
    }
    /// 0 running, else an index into `FINISH_REASONS`.
    #[getter]
    fn finish_codes(&self, py: Python<'_>) -> PyResult<Py<PyArray1<u8>>> {
        self.finish_codes.get(py)
    }
    /// Prompt tokens each request took from the prefix cache (at its first admission).
    #[getter]
    fn num_cached_tokens(&self, py: Python<'_>) -> PyResult<Py<PyArray1<u32>>> {
        self.num_cached_tokens.get(py)
    }

    /// `[(handle, new_token_ids, finish_reason or None)]`
    fn items(&self) -> Vec<CommitItem> {
        let (h, o, t, c) = (&self.handles.data, &self.offsets.data, &self.new_tokens.data, &self.finish_codes.data);
        (0..h.len())
            .map(|i| (h[i], t[o[i] as usize..o[i + 1] as usize].to_vec(), FinishReason::NAMES[c[i] as usize]))
            .collect()
    }
}

#[pyclass(name = "Scheduler", module = "dflash_engine._core")]
pub struct PyScheduler {
    inner: Scheduler,
}

impl PyScheduler {
    fn live(&self, handle: u64) -> PyResult<&crate::request::Request> {
        self.inner.request(handle).ok_or_else(|| to_py(CoreError::UnknownRequest(format!("handle {handle}"))))
    }
}

#[pymethods]
impl PyScheduler {
    #[new]
    #[pyo3(signature = (*, num_pages, page_size, max_num_seqs, max_num_batched_tokens, max_model_len,
                        num_speculative_tokens = 0, mask_token_id = 0, enable_prefix_caching = true,
                        draft_len_schedule = Vec::new(), draft_block_rows = 0, draft_len_policy = "fixed",
                        draft_len_candidates = Vec::new(), state_slots = false))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        num_pages: usize,
        page_size: usize,
        max_num_seqs: usize,
        max_num_batched_tokens: usize,
        max_model_len: usize,
        num_speculative_tokens: usize,
        mask_token_id: u32,
        enable_prefix_caching: bool,
        draft_len_schedule: Vec<(usize, usize)>,
        draft_block_rows: usize,
        draft_len_policy: &str,
        draft_len_candidates: Vec<i64>,
        state_slots: bool,
    ) -> PyResult<Self> {
        let candidates = counts_vec(draft_len_candidates, "draft_len_candidates")?;
        let draft_len_policy = parse_policy(draft_len_policy, draft_len_schedule, candidates, num_speculative_tokens)?;
        let cfg = SchedulerConfig {
            num_pages,
            page_size,
            max_num_seqs,
            max_num_batched_tokens,
            max_model_len,
            num_speculative_tokens,
            mask_token_id,
            enable_prefix_caching,
            draft_len_policy,
            draft_block_rows,
            state_slots,
        };
        Ok(PyScheduler { inner: Scheduler::new(cfg).map_err(to_py)? })
    }

    /// Queue a request; returns its handle. Bad input raises `RequestRejectedError`
    /// (a `ValueError`) naming the parameter; a live id raises `DuplicateRequestError`.
    #[pyo3(signature = (request_id, prompt_token_ids, max_tokens, stop_token_ids = None))]
    fn add_request(
        &mut self,
        py: Python<'_>,
        request_id: &str,
        prompt_token_ids: &Bound<'_, PyAny>,
        max_tokens: &Bound<'_, PyAny>,
        stop_token_ids: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<u64> {
        let reject =
            |param: Param| move |m: String| rejected(py, param, format!("request {request_id:?} rejected: {m}"));
        let prompt = u32_vec(prompt_token_ids, "prompt_token_ids", reject(Param::Prompt))?;
        let max_tokens: usize =
            max_tokens.extract::<u64>().ok().and_then(|v| usize::try_from(v).ok()).ok_or_else(|| {
                reject(Param::MaxTokens)(format!("max_tokens must be a non-negative integer, got {max_tokens}"))
            })?;
        let stops = match stop_token_ids {
            Some(s) => u32_vec(s, "stop_token_ids", reject(Param::StopTokenIds))?,
            None => Vec::new(),
        };
        self.inner.add_request(request_id, prompt, max_tokens, stops).map_err(to_py)
    }

    /// The one request-id registry: handle of a live request id.
    fn handle_of(&self, request_id: &str) -> Option<u64> {
        self.inner.handle_of(request_id)
    }

    fn abort(&mut self, handle: u64) -> PyResult<()> {
        self.inner.finish(handle, FinishReason::Abort).map_err(to_py)
    }

    fn finish(&mut self, handle: u64, reason: &str) -> PyResult<()> {
        self.inner.finish(handle, parse_reason(reason)?).map_err(to_py)
    }

    /// The next step's plan, or None when there is nothing to run (nothing to commit then).
    fn schedule(&mut self, py: Python<'_>) -> PyResult<Option<PyStepPlan>> {
        match self.inner.schedule().map_err(to_py)? {
            Some((ticket, plan)) => Ok(Some(PyStepPlan::new(py, ticket, plan)?)),
            None => Ok(None),
        }
    }

    /// A step for one running request alone (None if it is not running).
    fn schedule_only(&mut self, py: Python<'_>, handle: u64) -> PyResult<Option<PyStepPlan>> {
        match self.inner.schedule_only(handle).map_err(to_py)? {
            Some((ticket, plan)) => Ok(Some(PyStepPlan::new(py, ticket, plan)?)),
            None => Ok(None),
        }
    }

    /// Apply a step's results, spending the plan's ticket; a refused commit keeps it.
    fn commit(
        &mut self,
        plan: &PyStepPlan,
        accepted: &Bound<'_, PyAny>,
        sampled: &Bound<'_, PyAny>,
    ) -> PyResult<PyCommitResult> {
        let acc = u32_vec(accepted, "accepted", commit_error("accepted"))?;
        let smp = u32_vec(sampled, "sampled", commit_error("sampled"))?;
        let b = match self.inner.commit(plan.take_ticket()?, &acc, &smp) {
            Ok(b) => b,
            Err(refused) => {
                plan.return_ticket(refused.ticket);
                return Err(to_py(refused.error));
            }
        };
        Ok(PyCommitResult {
            handles: Lazy::new(b.handles),
            offsets: Lazy::new(b.offsets),
            new_tokens: Lazy::new(b.tokens),
            finish_codes: Lazy::new(b.finish),
            num_cached_tokens: Lazy::new(b.num_cached_tokens),
        })
    }

    fn cancel(&mut self, plan: &PyStepPlan) -> PyResult<()> {
        self.inner.cancel(plan.take_ticket()?).map_err(to_py)
    }

    #[pyo3(signature = (plan, reason = "error"))]
    fn fail(&mut self, plan: &PyStepPlan, reason: &str) -> PyResult<Vec<u64>> {
        let reason = parse_reason(reason)?;
        self.inner.fail(plan.take_ticket()?, reason).map_err(to_py)
    }

    /// (phase, computed-or-committed, tokens) of a live request.
    fn request_state(&self, handle: u64) -> PyResult<(&'static str, usize, Vec<u32>)> {
        let r = self.live(handle)?;
        Ok((r.phase().name(), r.num_computed(), r.tokens().to_vec()))
    }

    /// (committed state slot or -1, owned state slots) of a live request (hybrid targets).
    fn state_slots(&self, handle: u64) -> PyResult<(i64, Vec<u32>)> {
        let r = self.live(handle)?;
        Ok((r.committed_slot().map_or(-1, |p| p as i64), r.state_slots().to_vec()))
    }

    /// Prompt tokens a live request took from the prefix cache at its first admission.
    fn num_cached_tokens(&self, handle: u64) -> PyResult<usize> {
        Ok(self.live(handle)?.num_cached_tokens())
    }

    /// Measured seconds of a decode step: `seconds[i][j]` for a batch padded to `buckets[i]`
    /// drafting `ks[j]` (0: a plain decode step). Bad shapes or costs raise `ValueError`.
    fn set_step_costs(&mut self, buckets: Vec<i64>, ks: Vec<i64>, seconds: Vec<Vec<f64>>) -> PyResult<()> {
        let value_error = |e: CoreError| pyo3::exceptions::PyValueError::new_err(e.to_string());
        let costs =
            StepCosts::new(counts_vec(buckets, "buckets")?, counts_vec(ks, "ks")?, seconds).map_err(value_error)?;
        self.inner.set_step_costs(costs).map_err(value_error)
    }

    /// The prefill a step with decoding requests carries at most: `tokens` rows in at most
    /// `requests` chunks (the runner's mixed-step graphs); 0 and 0 lift the limit.
    fn set_mixed_step_limit(&mut self, tokens: usize, requests: usize) -> PyResult<()> {
        let limit = (tokens > 0 || requests > 0).then_some(MixedStepLimit { tokens, requests });
        self.inner.set_mixed_step_limit(limit).map_err(|e| pyo3::exceptions::PyValueError::new_err(e.to_string()))
    }

    /// (tokens, requests) of the mixed-step limit; (0, 0) when there is none.
    fn mixed_step_limit(&self) -> (usize, usize) {
        self.inner.mixed_step_limit().map_or((0, 0), |l| (l.tokens, l.requests))
    }

    /// `{k: planned steps with decoding requests that drafted k}`, every k the policy can choose.
    fn draft_len_counts(&self) -> std::collections::BTreeMap<usize, u64> {
        self.inner.draft_len().counts().into_iter().collect()
    }

    /// c_1..c_K: per draft position, observed over predicted acceptances through it
    /// (draft_len.rs, "Calibration"; 1 before any; what the adaptive policy scales by).
    fn acceptance_calibration(&self) -> Vec<f64> {
        let dl = self.inner.draft_len();
        (1..=self.inner.config().num_speculative_tokens).map(|j| dl.calibration(j)).collect()
    }

    /// Global acceptance estimates p_1..p_K: P(draft j accepted | drafts 1..j-1 were).
    fn acceptance_estimates(&self) -> Vec<f64> {
        self.inner.draft_len().global_estimates()
    }

    /// K the next `schedule()` drafts for the requests decoding now.
    fn next_draft_len(&self) -> usize {
        self.inner.next_draft_len()
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
    fn enable_prefix_caching(&self) -> bool {
        self.inner.config().enable_prefix_caching
    }
    /// Tokens of admitted requests looked up in the prefix cache.
    #[getter]
    fn prefix_cache_queries(&self) -> u64 {
        self.inner.prefix_cache_queries()
    }
    /// Tokens served from the prefix cache.
    #[getter]
    fn prefix_cache_hits(&self) -> u64 {
        self.inner.prefix_cache_hits()
    }
    /// Published pages (in use or free).
    #[getter]
    fn num_cached_pages(&self) -> usize {
        self.inner.pool().num_cached()
    }
    #[getter]
    fn page_size(&self) -> usize {
        self.inner.config().page_size
    }
    /// State slots a decoding request holds (0 without state slots).
    #[getter]
    fn state_slots_per_seq(&self) -> usize {
        self.inner.config().state_slots_per_seq()
    }
    #[getter]
    fn block_rows(&self) -> usize {
        self.inner.config().block_rows()
    }
    /// "fixed", "schedule" or "adaptive".
    #[getter]
    fn draft_len_policy(&self) -> &'static str {
        self.inner.config().draft_len_policy.name()
    }
    #[getter]
    fn outstanding_step(&self) -> Option<u64> {
        self.inner.outstanding_step()
    }
}

/// Drafts of a step with `num_decoding` decoding requests under `schedule` (the scheduler's
/// own rule; see `SchedulerConfig::block_rows_for`).
#[pyfunction]
#[pyo3(name = "draft_len_for")]
fn py_draft_len_for(schedule: Vec<(usize, usize)>, k_max: usize, num_decoding: usize) -> usize {
    draft_len_for(&schedule, k_max, num_decoding)
}

/// Pages one request of `max_model_len` tokens holds at most (the core's admission bound);
/// `reserve_rows`: rows a decode step writes from `committed`, max(B, D).
#[pyfunction]
#[pyo3(name = "pages_per_seq")]
fn py_pages_per_seq(max_model_len: usize, reserve_rows: usize, page_size: usize) -> PyResult<usize> {
    if page_size == 0 || reserve_rows == 0 {
        return Err(pyo3::exceptions::PyValueError::new_err("page_size and reserve_rows must be >= 1"));
    }
    Ok(pages_per_seq(max_model_len, reserve_rows, page_size))
}

/// State slots one decoding request holds with `num_speculative_tokens` (the committed one
/// and one per verify row; `SchedulerConfig::state_slots_per_seq`), for sizing pools in Python.
#[pyfunction]
#[pyo3(name = "state_slots_per_seq")]
fn py_state_slots_per_seq(num_speculative_tokens: usize) -> usize {
    state_slots_per_seq(num_speculative_tokens)
}

/// D of a step verifying `block_rows` rows with a draft trained on `draft_block_rows`-row
/// blocks (0: no draft pass).
#[pyfunction]
#[pyo3(name = "draft_pass_rows")]
fn py_draft_pass_rows(block_rows: usize, draft_block_rows: usize) -> usize {
    crate::plan::draft_pass_rows(block_rows, draft_block_rows)
}

/// The largest eager step the engine can run, as a plan over a 2-page KV cache (see
/// `profile::profile_plan`); it carries no ticket (nothing commits it).
#[pyfunction]
#[pyo3(name = "profile_plan", signature = (num_tokens, max_num_seqs, block_rows, draft_block_rows, reserve_rows,
                                             max_model_len, page_size, mask_token_id, state_slots = false))]
#[allow(clippy::too_many_arguments)]
fn py_profile_plan(
    py: Python<'_>,
    num_tokens: usize,
    max_num_seqs: usize,
    block_rows: usize,
    draft_block_rows: usize,
    reserve_rows: usize,
    max_model_len: usize,
    page_size: usize,
    mask_token_id: u32,
    state_slots: bool,
) -> PyResult<PyStepPlan> {
    let plan = crate::profile::profile_plan(
        num_tokens,
        max_num_seqs,
        block_rows,
        draft_block_rows,
        reserve_rows,
        max_model_len,
        page_size,
        mask_token_id,
        state_slots,
    )
    .map_err(to_py)?;
    PyStepPlan::build(py, None, plan)
}

// ---- staging a plan into a step graph's buffers (staging.rs) --------------------------------

fn value_error(m: String) -> PyErr {
    pyo3::exceptions::PyValueError::new_err(m)
}

/// The prefill tokens of a plan that a mixed-step graph can replay, or None (see
/// `staging::mixed_prefill_tokens`).
#[pyfunction]
#[pyo3(name = "mixed_prefill_tokens")]
fn py_mixed_prefill_tokens(
    query_start_loc: PyReadonlyArray1<'_, i32>,
    sample_start: PyReadonlyArray1<'_, i64>,
    sample_rows: PyReadonlyArray1<'_, i64>,
    num_decode: usize,
    block_rows: usize,
    max_prefill_requests: usize,
) -> PyResult<Option<usize>> {
    Ok(crate::staging::mixed_prefill_tokens(
        query_start_loc.as_slice()?,
        sample_start.as_slice()?,
        sample_rows.as_slice()?,
        num_decode,
        block_rows,
        max_prefill_requests,
    ))
}

/// A mixed plan's sample rows and verify rows written into `srows` / `vrows` (views of the
/// graph runner's staging buffer) for bucket `bs`; -> each plan sample row's slot (int64).
#[pyfunction]
#[pyo3(name = "stage_mixed_rows")]
#[allow(clippy::too_many_arguments)]
fn py_stage_mixed_rows<'py>(
    py: Python<'py>,
    mut srows: PyReadwriteArray1<'_, i64>,
    mut vrows: PyReadwriteArray1<'_, i64>,
    query_start_loc: PyReadonlyArray1<'_, i32>,
    sample_start: PyReadonlyArray1<'_, i64>,
    num_decode: usize,
    bs: usize,
    block_rows: usize,
) -> PyResult<Bound<'py, PyArray1<i64>>> {
    let slot_of = crate::staging::stage_mixed_rows(
        srows.as_slice_mut()?,
        vrows.as_slice_mut()?,
        query_start_loc.as_slice()?,
        sample_start.as_slice()?,
        num_decode,
        bs,
        block_rows,
    )
    .map_err(value_error)?;
    Ok(slot_of.into_pyarray(py))
}

/// Per-request sampling parameters into their sample slots: for each `(dst, values, pad)`
/// of `int_fields` (int64) and `float_fields` (float32), `dst` (a slot per sample slot) gets
/// `pad`, then each request's value in its rows' slots (`mixed = (num_decode, first prefill
/// slot)` for a mixed step); see `staging::stage_sampling`. Checks every field first.
#[pyfunction]
#[pyo3(name = "stage_sampling", signature = (int_fields, float_fields, sample_start, mixed = None))]
fn py_stage_sampling(
    int_fields: Vec<(PyReadwriteArray1<'_, i64>, PyReadonlyArray1<'_, i64>, i64)>,
    float_fields: Vec<(PyReadwriteArray1<'_, f32>, PyReadonlyArray1<'_, f32>, f32)>,
    sample_start: PyReadonlyArray1<'_, i64>,
    mixed: Option<(usize, usize)>,
) -> PyResult<()> {
    let ss = sample_start.as_slice()?;
    let mut ints = int_fields;
    let mut floats = float_fields;
    // Check all first: a refused field must not leave the others half-written.
    for (dst, values, _) in ints.iter() {
        crate::staging::check_sampling(dst.as_array().len(), values.as_array().len(), ss, mixed)
            .map_err(value_error)?;
    }
    for (dst, values, _) in floats.iter() {
        crate::staging::check_sampling(dst.as_array().len(), values.as_array().len(), ss, mixed)
            .map_err(value_error)?;
    }
    for (dst, values, pad) in ints.iter_mut() {
        crate::staging::stage_sampling(dst.as_slice_mut()?, values.as_slice()?, *pad, ss, mixed)
            .map_err(value_error)?;
    }
    for (dst, values, pad) in floats.iter_mut() {
        crate::staging::stage_sampling(dst.as_slice_mut()?, values.as_slice()?, *pad, ss, mixed)
            .map_err(value_error)?;
    }
    Ok(())
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add_class::<PyScheduler>()?;
    m.add_class::<PyStepPlan>()?;
    m.add_class::<PyCommitResult>()?;
    m.add("CoreError", py.get_type::<exc::CoreError>())?;
    m.add("InvalidConfigError", py.get_type::<exc::InvalidConfigError>())?;
    m.add("RequestRejectedError", request_rejected_type(py)?)?;
    m.add("DuplicateRequestError", py.get_type::<exc::DuplicateRequestError>())?;
    m.add("UnknownRequestError", py.get_type::<exc::UnknownRequestError>())?;
    m.add("PlanOutstandingError", py.get_type::<exc::PlanOutstandingError>())?;
    m.add("StalePlanError", py.get_type::<exc::StalePlanError>())?;
    m.add("InvalidCommitError", py.get_type::<exc::InvalidCommitError>())?;
    m.add("NULL_PAGE", crate::page_pool::NULL_PAGE)?;
    m.add("FINISH_REASONS", FinishReason::NAMES.to_vec())?;
    m.add_function(wrap_pyfunction!(py_pages_per_seq, m)?)?;
    m.add_function(wrap_pyfunction!(py_profile_plan, m)?)?;
    m.add_function(wrap_pyfunction!(py_mixed_prefill_tokens, m)?)?;
    m.add_function(wrap_pyfunction!(py_stage_mixed_rows, m)?)?;
    m.add_function(wrap_pyfunction!(py_stage_sampling, m)?)?;
    m.add_function(wrap_pyfunction!(py_stage_arrays, m)?)?;
    m.add_function(wrap_pyfunction!(py_draft_pass_rows, m)?)?;
    m.add_function(wrap_pyfunction!(py_draft_len_for, m)?)?;
    m.add_function(wrap_pyfunction!(py_state_slots_per_seq, m)?)?;
    Ok(())
}
