package db_test

import (
	"testing"

	"github.com/modkit-go/modkit/internal/pgtest"
)

func TestMain(m *testing.M) { pgtest.Main(m) }
