//! Runs on every machine: opening a device never panics. Without libcuda it is a typed error.

use msa_runtime::{driver_present, Device, RuntimeError};

#[test]
fn opening_a_device_is_an_error_not_a_panic() {
    match Device::open(0) {
        Ok(dev) => {
            assert!(driver_present());
            assert!(dev.sm_count() > 0);
            // Memoized: the second open returns the same device.
            assert!(std::sync::Arc::ptr_eq(&dev, &Device::open(0).unwrap()));
        }
        Err(RuntimeError::NoDriver) => assert!(!driver_present()),
        Err(RuntimeError::NoDevice { ordinal, .. }) => assert_eq!(ordinal, 0),
        Err(e) => panic!("unexpected error: {e}"),
    }
    if driver_present() {
        assert!(matches!(
            Device::open(4096),
            Err(RuntimeError::NoDevice { ordinal: 4096, .. })
        ));
    }
}

#[test]
fn a_raw_stream_without_a_driver_is_an_error_not_a_panic() {
    // SAFETY: the legacy default stream handle; without a driver nothing is called, with one
    // it names the calling thread's current context (none here: a typed driver error).
    let r = unsafe { msa_runtime::CudaBackend::from_raw_stream(std::ptr::null_mut()) };
    match r {
        Err(RuntimeError::NoDriver) => assert!(!driver_present()),
        Err(RuntimeError::Driver { .. }) | Ok(_) => assert!(driver_present()),
        Err(e) => panic!("unexpected error: {e}"),
    }
}
