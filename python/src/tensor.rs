//! The tensor protocol the extension reads: any object with `dtype`, `shape`, `stride()`,
//! `device` (with `type` and `index`) and `data_ptr()`, as `torch.Tensor` has. Reading only
//! these keeps the extension free of a torch build dependency and lets the checks be tested
//! with stand-in objects on a machine without torch or a GPU.

use crate::error::{device_error, type_error, value_error};
use pyo3::prelude::*;

/// Element types the kernels take, as `str(tensor.dtype)` spells them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dtype {
    /// `torch.bfloat16`.
    Bf16,
    /// `torch.float32`.
    F32,
    /// `torch.int32`.
    I32,
}

impl Dtype {
    fn name(self) -> &'static str {
        match self {
            Dtype::Bf16 => "torch.bfloat16",
            Dtype::F32 => "torch.float32",
            Dtype::I32 => "torch.int32",
        }
    }
}

/// What the protocol said about one argument.
#[derive(Debug, Clone)]
pub struct Tensor {
    /// The argument's name in the Python signature; every error names it.
    pub name: &'static str,
    dtype: String,
    /// Sizes, outermost first.
    pub shape: Vec<usize>,
    strides: Vec<i64>,
    device_type: String,
    device_index: Option<i64>,
    /// `data_ptr()`: the address of the first element.
    pub ptr: u64,
}

fn attr<'py>(
    obj: &Bound<'py, PyAny>,
    name: &'static str,
    what: &str,
) -> PyResult<Bound<'py, PyAny>> {
    obj.getattr(what).map_err(|_| not_a_tensor(obj, name))
}

fn not_a_tensor(obj: &Bound<'_, PyAny>, name: &str) -> PyErr {
    let ty = obj
        .get_type()
        .name()
        .map(|n| n.to_string())
        .unwrap_or_else(|_| "?".into());
    type_error(name, format!("an object of type {ty}"), "a torch.Tensor")
}

impl Tensor {
    /// Reads the protocol from `obj`; a missing or malformed attribute is a `TypeError`
    /// naming the argument.
    pub fn read(name: &'static str, obj: &Bound<'_, PyAny>) -> PyResult<Tensor> {
        let bad = |_| not_a_tensor(obj, name);
        let dtype = attr(obj, name, "dtype")?.str()?.to_string();
        let shape: Vec<usize> = attr(obj, name, "shape")?.extract().map_err(bad)?;
        let strides: Vec<i64> = attr(obj, name, "stride")?
            .call0()
            .and_then(|s| s.extract())
            .map_err(bad)?;
        let device = attr(obj, name, "device")?;
        let device_type = attr(&device, name, "type")?.str()?.to_string();
        let device_index: Option<i64> = attr(&device, name, "index")?.extract().map_err(bad)?;
        let ptr: u64 = attr(obj, name, "data_ptr")?
            .call0()
            .and_then(|p| p.extract())
            .map_err(bad)?;
        if strides.len() != shape.len() {
            return Err(not_a_tensor(obj, name));
        }
        Ok(Tensor {
            name,
            dtype,
            shape,
            strides,
            device_type,
            device_index,
            ptr,
        })
    }

    /// Elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// The tensor's memory as the runtime's typed span (element type checked by the caller).
    pub fn span<T>(&self) -> msa_runtime::Span<T> {
        msa_runtime::Span::new(self.ptr, self.numel())
    }

    /// `TypeError` unless the dtype is `want`.
    pub fn expect_dtype(&self, want: Dtype) -> PyResult<()> {
        if self.dtype == want.name() {
            return Ok(());
        }
        Err(type_error(
            self.name,
            format!("dtype {}", self.dtype),
            want.name(),
        ))
    }

    /// `ValueError` unless the shape is `want`; `text` spells the expectation (e.g.
    /// `[T, 64, 128] with T = 135, the schedule's tokens`).
    pub fn expect_shape(&self, want: &[usize], text: &str) -> PyResult<()> {
        if self.shape == want {
            return Ok(());
        }
        Err(value_error(
            self.name,
            format!("shape {:?}", self.shape),
            text,
        ))
    }

    /// The CUDA device index; `NotImplementedError` for a tensor anywhere else.
    pub fn cuda_index(&self) -> PyResult<usize> {
        if self.device_type != "cuda" {
            return Err(device_error(
                self.name,
                format!("a tensor on device type `{}`", self.device_type),
                "a CUDA tensor (the kernels run on compute capability 9.0 and 10.0)",
            ));
        }
        match self.device_index {
            Some(i) if i >= 0 => Ok(i as usize),
            other => Err(value_error(
                self.name,
                format!("device index {other:?}"),
                "a CUDA tensor with a device index",
            )),
        }
    }

    /// Whether the tensor is on the CPU.
    pub fn is_cpu(&self) -> bool {
        self.device_type == "cpu"
    }

    /// Row-major contiguous (dimensions of size 1 may have any stride).
    pub fn is_contiguous(&self) -> bool {
        let mut expect = 1i64;
        for (&n, &s) in self.shape.iter().zip(&self.strides).rev() {
            if n != 1 && s != expect {
                return false;
            }
            expect = expect.saturating_mul(n as i64);
        }
        true
    }

    /// `ValueError` unless contiguous with a base aligned to `align` bytes. The Python layer
    /// copies inputs that are not (`msa_ptx._operand`); this check guards the raw entry points.
    pub fn expect_dense(&self, align: u64) -> PyResult<()> {
        if !self.is_contiguous() {
            return Err(value_error(
                self.name,
                format!("strides {:?} for shape {:?}", self.strides, self.shape),
                "a contiguous tensor (msa_ptx.run_backward copies non-contiguous inputs)",
            ));
        }
        if self.numel() > 0 && (self.ptr == 0 || !self.ptr.is_multiple_of(align)) {
            return Err(value_error(
                self.name,
                format!("data_ptr() = {:#x}", self.ptr),
                &format!(
                    "a non-null address aligned to {align} bytes \
                     (msa_ptx.run_backward copies misaligned inputs)"
                ),
            ));
        }
        Ok(())
    }

    /// The elements of a contiguous CPU `int32` tensor, copied.
    pub fn host_i32(&self) -> PyResult<Vec<i32>> {
        self.expect_dtype(Dtype::I32)?;
        if !self.is_cpu() {
            return Err(value_error(
                self.name,
                format!("a tensor on `{}`", self.device_type),
                "a CPU tensor here (the Python layer copies device fields to the host)",
            ));
        }
        self.expect_dense(4)?;
        let n = self.numel();
        if n == 0 {
            return Ok(Vec::new());
        }
        // SAFETY: the object reported, through the tensor protocol, a contiguous int32 CPU
        // buffer of `n` elements at this 4-byte aligned, non-null address; the caller holds a
        // reference to it (and the GIL) for the duration of the copy. As with any
        // `data_ptr()` consumer, an object that lies about its memory is not protected against.
        let data = unsafe { std::slice::from_raw_parts(self.ptr as *const i32, n) };
        Ok(data.to_vec())
    }
}

/// The one CUDA device of `tensors`: `NotImplementedError` for a tensor off CUDA, `ValueError`
/// when two are on different devices.
pub fn common_device(tensors: &[&Tensor]) -> PyResult<usize> {
    let mut device = None;
    for t in tensors {
        let d = t.cuda_index()?;
        match device {
            None => device = Some((d, t.name)),
            Some((first, name)) if first != d => {
                return Err(value_error(
                    t.name,
                    format!("a tensor on cuda:{d}"),
                    &format!("the device of `{name}`, cuda:{first}"),
                ))
            }
            Some(_) => {}
        }
    }
    Ok(device.map_or(0, |(d, _)| d))
}
