//! Where a model runs: the [`Device`] a caller asks for, and what [`crate::Model`] needs from
//! the backend behind it.

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use markbase_core::backend::Backend;
use markbase_core::{Error, Result};
use markbase_cpu::CpuBackend;
use markbase_cuda::CudaBackend;

/// The device a model is loaded onto.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Device {
    /// The CPU backend (threads from [`crate::LoadOptions::threads`]).
    #[default]
    Cpu,
    /// The CUDA backend on the GPU of this ordinal.
    Cuda(usize),
}

impl FromStr for Device {
    type Err = Error;

    /// Parses `cpu`, `cuda` (GPU 0) or `cuda:N`.
    fn from_str(s: &str) -> Result<Device> {
        let bad = || Error::Invalid(format!("'{s}' is not a device (cpu, cuda, cuda:N)"));
        match s {
            "cpu" => Ok(Device::Cpu),
            "cuda" => Ok(Device::Cuda(0)),
            _ => {
                let n = s.strip_prefix("cuda:").ok_or_else(bad)?;
                n.parse().map(Device::Cuda).map_err(|_| bad())
            }
        }
    }
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu => write!(f, "cpu"),
            Device::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

/// A backend a [`crate::Model`] can run on.
pub(crate) trait DeviceBackend: Backend + 'static {
    /// What the model runs on, for people ("cpu (2 threads)", "cuda:0 NVIDIA H200").
    fn describe(&self) -> String;
    /// Prepares the calling thread to queue work (a step may run on any thread).
    fn enter_thread(&self) -> Result<()>;
    /// Times the host has waited for the device so far (0 where the host computes itself).
    fn host_waits(&self) -> u64;
    /// Time the host has spent in those waits.
    fn host_wait_time(&self) -> Duration;
    /// Steps that ran as one CUDA graph launch so far (0 where there are none).
    fn graph_replays(&self) -> u64;
    /// Token-row counts whose first step makes one-off plans ([`crate::Model::warm_up_rows`]).
    fn warm_up_rows(&self) -> Vec<usize>;
    /// Device bytes held by f16 copies of quantized weights ([`crate::Model::f16_copy_bytes`]).
    fn f16_copy_bytes(&self) -> usize;
    /// The device's free and total memory ([`crate::Model::device_memory`]).
    fn device_memory(&self) -> Result<Option<(usize, usize)>>;
}

impl DeviceBackend for CpuBackend {
    fn describe(&self) -> String {
        format!("cpu ({} threads)", self.threads())
    }

    fn enter_thread(&self) -> Result<()> {
        Ok(())
    }

    fn host_waits(&self) -> u64 {
        0
    }

    fn host_wait_time(&self) -> Duration {
        Duration::ZERO
    }

    fn graph_replays(&self) -> u64 {
        0
    }

    fn warm_up_rows(&self) -> Vec<usize> {
        Vec::new()
    }

    fn f16_copy_bytes(&self) -> usize {
        0
    }

    fn device_memory(&self) -> Result<Option<(usize, usize)>> {
        Ok(None)
    }
}

impl DeviceBackend for CudaBackend {
    fn describe(&self) -> String {
        let d = self.device();
        format!("cuda:{} {}", d.ordinal(), d.name())
    }

    fn enter_thread(&self) -> Result<()> {
        self.device().bind_to_thread()
    }

    fn host_waits(&self) -> u64 {
        self.device().host_waits()
    }

    fn host_wait_time(&self) -> Duration {
        self.device().host_wait_time()
    }

    fn graph_replays(&self) -> u64 {
        // A poisoned recorder already fails every step; 0 here keeps the count readable.
        CudaBackend::graph_replays(self).unwrap_or(0)
    }

    fn warm_up_rows(&self) -> Vec<usize> {
        self.timed_row_runs()
    }

    fn f16_copy_bytes(&self) -> usize {
        CudaBackend::f16_copy_bytes(self)
    }

    fn device_memory(&self) -> Result<Option<(usize, usize)>> {
        self.device().memory().map(Some)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_prints() {
        for (s, d) in [
            ("cpu", Device::Cpu),
            ("cuda", Device::Cuda(0)),
            ("cuda:0", Device::Cuda(0)),
            ("cuda:3", Device::Cuda(3)),
        ] {
            assert_eq!(s.parse::<Device>().unwrap(), d, "{s}");
        }
        assert_eq!(Device::Cuda(3).to_string(), "cuda:3");
        assert_eq!(Device::default().to_string(), "cpu");
        for bad in ["", "gpu", "cuda:", "cuda:x", "cuda:-1", "CPU", "cuda0"] {
            let e = bad.parse::<Device>().unwrap_err().to_string();
            assert!(e.contains("is not a device"), "{bad}: {e}");
        }
    }
}
